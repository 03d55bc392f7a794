"""A request's sampling parameters: vLLM's ``SamplingParams`` fields, checked once on creation.

Every value reaches the ranks as an array element of a fixed dtype (int32 ids and counts,
float32 probabilities and penalties, int64 seeds), so anything that would not fit or would
turn the logits into NaNs is refused here, with the field's name, not mid-step on a rank.
Two values are normalised as vLLM normalises them: ``top_k=-1`` becomes 0 (both mean off), and
a greedy request (temperature 0) drops top_k/top_p/min_p, which cannot move its argmax -- so a
greedy row never pays for filtering.  A temperature in (0, 0.01) is raised to 0.01 (vLLM's
``_MAX_TEMP``): logits divided by less overflow float32.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import cached_property

MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: smaller temperatures are raised to it
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries: each is one (row, id) add on rank 0
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias in [-100, 100]
INT32_MAX = 2 ** 31 - 1


def _int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return int(v)


def _float(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how to draw it (vLLM's names and semantics).

    Logits are processed in vLLM's order: ``min_tokens`` masking, ``logit_bias`` and the penalties
    (repetition, frequency, presence) on the raw logits, then the temperature, then min_p, top_k
    and top_p;
    then the draw (argmax when ``temperature`` is 0).  ``logprobs`` are of the *raw* logits (vLLM's
    default ``raw_logprobs``)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy: argmax of the processed logits
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 = off; else >= 1
    min_p: float = 0.0  # [0, 1]
    presence_penalty: float = 0.0  # [-2, 2], on output tokens (OpenAI semantics)
    frequency_penalty: float = 0.0  # [-2, 2], on output token counts
    repetition_penalty: float = 1.0  # > 0, on prompt + output tokens (HF/vLLM semantics)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0  # stop ids and EOS are masked until this many tokens are out
    ignore_eos: bool = False  # else ModelConfig.eos_token_ids end generation ('stop')
    logprobs: int | None = None  # None: none; k in [0, 20]: the sampled token's + the top k
    # None: none; k in [0, 20]: each prompt token's logprob given the tokens before it, and the
    # top k there (vLLM's prompt_logprobs; the first token has none).  A request that asks
    # computes its whole prompt: it takes no prefix-cache hits, though others hit its blocks.
    prompt_logprobs: int | None = None
    # What the output must match (ray_attn.structured_output.StructuredOutputsParams); the
    # engine compiles it with its grammar compiler (LLMEngine.grammar_compiler).
    structured_outputs: object | None = None
    # (token id, bias) pairs added to the raw logits (OpenAI's logit_bias); a dict is accepted.
    # The engine checks the ids against the vocabulary.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        put("max_tokens", _int("max_tokens", self.max_tokens))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        t = _float("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        put("temperature", MIN_TEMPERATURE if 0 < t < MIN_TEMPERATURE else t)
        put("top_p", _float("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        put("top_k", _int("top_k", self.top_k))
        if self.top_k < -1 or self.top_k > INT32_MAX:
            raise ValueError(f"top_k must be 0 or -1 (off), or in [1, 2**31), got {self.top_k}")
        put("min_p", _float("min_p", self.min_p))
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = _float(name, getattr(self, name))
            if not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
            put(name, v)
        put("repetition_penalty", _float("repetition_penalty", self.repetition_penalty))
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            put("seed", _int("seed", self.seed))
            if not 0 <= self.seed < 2 ** 63:
                # the seed travels as an int64 to the ranks; a larger one would fail mid-step
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        stop = tuple(_int("stop_token_ids", t) for t in self.stop_token_ids)
        if any(not 0 <= t <= INT32_MAX for t in stop):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {list(stop)}")
        put("stop_token_ids", stop)
        put("min_tokens", _int("min_tokens", self.min_tokens))
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            put("logprobs", _int("logprobs", self.logprobs))
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None:
            put("prompt_logprobs", _int("prompt_logprobs", self.prompt_logprobs))
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be None or in [0, {MAX_LOGPROBS}], "
                                 f"got {self.prompt_logprobs}")
        put("logit_bias", _logit_bias(self.logit_bias))
        if self.structured_outputs is not None:
            from ray_attn.structured_output import StructuredOutputsParams

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
        if self.top_k == -1:
            put("top_k", 0)
        if self.temperature == 0:  # cannot move the argmax: a greedy row never filters
            put("top_p", 1.0)
            put("top_k", 0)
            put("min_p", 0.0)

    # Read every step for every row by the driver: computed once (a frozen dataclass's
    # cached_property writes the instance dict directly).
    @cached_property
    def filters(self) -> bool:
        """Whether the draw is restricted by top_k, top_p or min_p."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    @cached_property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @cached_property
    def plain(self) -> bool:
        """Needs nothing beyond temperature and seed on the ranks (the common case)."""
        return not (self.filters or self.penalized or self.min_tokens or self.logprobs is not None
                    or self.logit_bias or self.structured_outputs is not None)


def _logit_bias(v) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted, unique (id, bias) pairs, each id an int32 and each bias in range."""
    items = v.items() if isinstance(v, dict) else v
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise ValueError(f"logit_bias must map token ids to biases, got {v!r}")
    out: dict[int, float] = {}
    for pair in items:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got the entry {pair!r}")
        t, b = _int("logit_bias", pair[0]), _float("logit_bias", pair[1])
        if not 0 <= t <= INT32_MAX:
            raise ValueError(f"logit_bias: token id {t} is not >= 0")
        if not -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE:
            raise ValueError(f"logit_bias: bias {b} of token {t} is outside [-100, 100]")
        if t in out:
            raise ValueError(f"logit_bias: token id {t} appears twice")
        out[t] = b
    if len(out) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: {len(out)} entries exceeds the limit of {MAX_LOGIT_BIAS}")
    return tuple(sorted(out.items()))
