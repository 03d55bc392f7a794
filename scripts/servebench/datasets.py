"""Synthetic workloads as token-id prompts, with vLLM's dataset names and flags.

Prompts are lists of random token ids below the vocabulary size: the OpenAI completions API takes
``prompt`` as a list of ints, so neither side needs a tokenizer, and the engine transport feeds
the same lists to ``LLMEngine``.  Nothing is downloaded: ``sharegpt`` is a *synthetic* length
distribution shaped like ShareGPT's, not the dataset (see ``sharegpt_like_requests``).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "prefix_repetition", "sharegpt")

# ShareGPT (V3, Llama tokenizer) as reported in the vLLM paper (Kwon et al., 2023, Fig. 11):
# mean 161 input and 338 output tokens, both long-tailed.  vLLM's benchmark keeps a conversation
# when prompt >= 4, output >= 4, prompt <= 1024 and prompt + output <= 2048 tokens.
SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT = 161.0, 338.0
SHAREGPT_SIGMA_INPUT, SHAREGPT_SIGMA_OUTPUT = 1.0, 0.8
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


@dataclass
class SampleRequest:
    prompt: list[int]
    prompt_len: int
    expected_output_len: int


def _tokens(rng: np.random.Generator, vocab_size: int, n: int) -> list[int]:
    return rng.integers(0, vocab_size, n).tolist()


def random_requests(rng: np.random.Generator, vocab_size: int, num_requests: int, input_len: int,
                    output_len: int, range_ratio: float = 0.0, prefix_len: int = 0) -> list[SampleRequest]:
    """vLLM's ``random``: each request draws its input and output lengths uniformly from
    ``[len * (1 - range_ratio), len * (1 + range_ratio)]``; every prompt starts with the same
    ``prefix_len`` random tokens (a shared system prompt)."""
    def bounds(n: int) -> tuple[int, int]:
        return max(int(math.floor(n * (1 - range_ratio))), 1), int(math.ceil(n * (1 + range_ratio)))

    prefix = _tokens(rng, vocab_size, prefix_len)
    in_lo, in_hi = bounds(input_len)
    out_lo, out_hi = bounds(output_len)
    in_lens = rng.integers(in_lo, in_hi + 1, num_requests)
    out_lens = rng.integers(out_lo, out_hi + 1, num_requests)
    reqs = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        prompt = prefix + _tokens(rng, vocab_size, n_in)
        reqs.append(SampleRequest(prompt, len(prompt), n_out))
    return reqs


def prefix_repetition_requests(rng: np.random.Generator, vocab_size: int, num_requests: int,
                               prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int) -> list[SampleRequest]:
    """vLLM's ``prefix_repetition``: ``num_prefixes`` random prefixes, each followed by its own
    random suffixes, shuffled.  vLLM gives each prefix ``num_requests // num_prefixes`` prompts
    and drops the remainder; here the first ``num_requests % num_prefixes`` prefixes get one more,
    so that exactly ``num_requests`` are sent."""
    if num_requests < num_prefixes:
        raise ValueError(f"--num-prompts ({num_requests}) must be >= "
                         f"--prefix-repetition-num-prefixes ({num_prefixes})")
    reqs = []
    for i in range(num_prefixes):
        prefix = _tokens(rng, vocab_size, prefix_len)
        for _ in range(num_requests // num_prefixes + (i < num_requests % num_prefixes)):
            prompt = prefix + _tokens(rng, vocab_size, suffix_len)
            reqs.append(SampleRequest(prompt, len(prompt), output_len))
    order = rng.permutation(len(reqs))
    return [reqs[i] for i in order.tolist()]


def _lognormal(rng: np.random.Generator, mean: float, sigma: float) -> int:
    return int(round(rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma)))


def sharegpt_like_requests(rng: np.random.Generator, vocab_size: int, num_requests: int,
                           output_len: int | None = None) -> list[SampleRequest]:
    """A synthetic stand-in for ShareGPT (nothing can be downloaded here): input and output
    lengths are log-normal with ShareGPT's means, kept under vLLM's ShareGPT filter (prompt and
    output >= 4, prompt <= 1024, total <= 2048) by redrawing; prompts are random token ids.
    ``output_len`` fixes every output length (vLLM's ``--sharegpt-output-len``)."""
    reqs = []
    while len(reqs) < num_requests:
        n_in = _lognormal(rng, SHAREGPT_MEAN_INPUT, SHAREGPT_SIGMA_INPUT)
        n_out = output_len or _lognormal(rng, SHAREGPT_MEAN_OUTPUT, SHAREGPT_SIGMA_OUTPUT)
        if (n_in < SHAREGPT_MIN_LEN or n_out < SHAREGPT_MIN_LEN or n_in > SHAREGPT_MAX_PROMPT
                or n_in + n_out > SHAREGPT_MAX_TOTAL):
            continue
        reqs.append(SampleRequest(_tokens(rng, vocab_size, n_in), n_in, n_out))
    return reqs


def add_dataset_args(p: argparse.ArgumentParser, names=DATASETS) -> None:
    g = p.add_argument_group("dataset (synthetic, token-id prompts)")
    g.add_argument("--dataset-name", choices=names, default="random", help=(
        "random: random token ids, lengths from --random-*; prefix_repetition: a few shared "
        "prefixes with distinct suffixes (--prefix-repetition-*); sharegpt: a SYNTHETIC "
        "ShareGPT-like length distribution generated locally (log-normal lengths with ShareGPT's "
        "means, 161 in / 338 out, under vLLM's ShareGPT filter) -- not the dataset, which cannot "
        "be downloaded here") if "sharegpt" in names else "random or prefix_repetition")
    g.add_argument("--num-prompts", type=int, default=1000, help="number of requests")
    g.add_argument("--seed", type=int, default=0, help="seeds the prompts, lengths and arrivals")
    g.add_argument("--random-input-len", type=int, default=1024, help="random: input tokens per request")
    g.add_argument("--random-output-len", type=int, default=128, help="random: output tokens per request")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths drawn from [len*(1-r), len*(1+r)], 0 <= r < 1")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="random: tokens of one prefix shared by every prompt (before the random part)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="prefix_repetition: prefix tokens")
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="prefix_repetition: suffix tokens")
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                   help="prefix_repetition: distinct prefixes")
    g.add_argument("--prefix-repetition-output-len", type=int, default=128, help="prefix_repetition: output tokens")
    if "sharegpt" in names:
        g.add_argument("--sharegpt-output-len", type=int, default=None,
                       help="sharegpt: fix every output length instead of drawing it")


def check_dataset_args(args) -> list[str]:
    """One message per bad flag, each naming it."""
    errs = []
    positive = ["num_prompts", "random_input_len", "random_output_len",
                "prefix_repetition_suffix_len", "prefix_repetition_num_prefixes",
                "prefix_repetition_output_len"]
    for name in positive:
        if getattr(args, name) < 1:
            errs.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("random_prefix_len", "prefix_repetition_prefix_len"):
        if getattr(args, name) < 0:
            errs.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not 0 <= args.random_range_ratio < 1:
        errs.append(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if getattr(args, "sharegpt_output_len", None) is not None and args.sharegpt_output_len < 1:
        errs.append(f"--sharegpt-output-len must be >= 1, got {args.sharegpt_output_len}")
    return errs


def get_samples(args, vocab_size: int) -> list[SampleRequest]:
    if vocab_size < 1:
        raise ValueError(f"vocab size must be >= 1, got {vocab_size}")
    rng = np.random.default_rng(args.seed)
    if args.dataset_name == "random":
        return random_requests(rng, vocab_size, args.num_prompts, args.random_input_len,
                               args.random_output_len, args.random_range_ratio, args.random_prefix_len)
    if args.dataset_name == "prefix_repetition":
        return prefix_repetition_requests(
            rng, vocab_size, args.num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len)
    if args.dataset_name == "sharegpt":
        return sharegpt_like_requests(rng, vocab_size, args.num_prompts, args.sharegpt_output_len)
    raise ValueError(f"--dataset-name must be one of {DATASETS}, got {args.dataset_name!r}")
