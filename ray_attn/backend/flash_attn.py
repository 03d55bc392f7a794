"""The FlashAttention backend that every worker runs: paged KV, cascade and local attention.

Behaviour follows vLLM v1's ``FlashAttentionImpl``: K/V are written into the paged cache through
``slot_mapping``, then one of three paths runs -- plain varlen paged attention, chunked-local
attention over virtual batches, or cascade attention (shared prefix + per-request suffix merged by
LSE).  Our cascade runs several prefix groups in one pass (see ``cascade_attention``).
"""

from __future__ import annotations

import enum

import torch

from ray_attn.backend.cache import as_fp8_cache, is_fp8_kv_cache, reshape_and_cache_flash, scale_tensor
from ray_attn.backend.kernels import (Kernel, LayerKernelSpec, fp8_query, normalize_lse,
                                      select_kernel)
from ray_attn.backend.merge import merge_attn_states
from ray_attn.backend.validate import check_forward_inputs, complete_seed_cascade, is_capturing
from ray_attn.metadata import FlashAttentionMetadata


class AttentionType(str, enum.Enum):
    DECODER = "decoder"
    ENCODER = "encoder"
    ENCODER_ONLY = "encoder_only"
    ENCODER_DECODER = "encoder_decoder"


class FlashAttentionBackend:
    accept_output_buffer: bool = True

    @staticmethod
    def get_name() -> str:
        return "RAY_ATTN_FLASH_ATTN"

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return [32, 64, 96, 128, 160, 192, 224, 256]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        if block_size % 16 != 0:
            raise ValueError(f"Block size must be a multiple of 16, got block_size={block_size}")
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_impl_cls() -> type["FlashAttentionImpl"]:
        return FlashAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[FlashAttentionMetadata]:
        return FlashAttentionMetadata


# vLLM's defaults for calculate_kv_scales (Q/K/V_SCALE_CONSTANT): the first batch's absolute
# maximum lands at 200 (q, k) or 100 (v) of e4m3's 448, leaving headroom for later, larger values.
Q_SCALE_CONSTANT, K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 200.0, 100.0


class AttentionLayer:
    """The per-layer state the impl reads: fp8 scales, as on vLLM's ``Attention`` layer.

    The impl reads only the tensors ``_k_scale``/``_v_scale``/``_q_scale`` (on the device, so that
    a captured CUDA graph sees scales computed after capture); the ``*_float`` host copies are kept
    for callers that read them, as vLLM's layer has both.  A layer object with only the tensors
    (the seed's) works too.  With ``calculate_kv_scales`` the scales are computed from the first
    batch that reaches the layer, as vLLM's ``calc_kv_scales`` does, and fixed from then on.
    """

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0, q_scale: float = 1.0,
                 device="cpu", calculate_kv_scales: bool = False):
        self._k_scale = torch.tensor([k_scale], dtype=torch.float32, device=device)
        self._v_scale = torch.tensor([v_scale], dtype=torch.float32, device=device)
        self._q_scale = torch.tensor([q_scale], dtype=torch.float32, device=device)
        self._k_scale_float, self._v_scale_float, self._q_scale_float = k_scale, v_scale, q_scale
        self.calculate_kv_scales = calculate_kv_scales

    def calc_kv_scales(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        tiny = torch.finfo(torch.float32).tiny  # an all-zero batch must not give a zero scale
        for t, x, c in ((self._q_scale, query, Q_SCALE_CONSTANT), (self._k_scale, key, K_SCALE_CONSTANT),
                        (self._v_scale, value, V_SCALE_CONSTANT)):
            t.copy_((x.abs().amax().float() / c).clamp_min(tiny).reshape(t.shape))
        # One host read per layer, once: the float copies are for readers, not the hot path.
        self._q_scale_float, self._k_scale_float, self._v_scale_float = (
            float(self._q_scale.reshape(-1)[0]), float(self._k_scale.reshape(-1)[0]),
            float(self._v_scale.reshape(-1)[0]))
        self.calculate_kv_scales = False


def _layer_scales(layer, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, v, q) scales as float32 tensors on ``device``, from tensors or, failing those, floats."""
    out = []
    for name in ("_k_scale", "_v_scale", "_q_scale"):
        t = getattr(layer, name, None)
        if t is None:
            t = getattr(layer, name + "_float", None)
        if t is None:
            raise ValueError(f"an fp8 KV cache needs layer.{name} (a float32 tensor) or layer.{name}_float")
        out.append(scale_tensor(t, device))
    return out[0], out[1], out[2]


class FlashAttentionImpl:
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        blocksparse_params: dict | None = None,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        use_irope: bool = False,
        *,
        dtype: torch.dtype = torch.bfloat16,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        kernel: str = "auto",
    ) -> None:
        if blocksparse_params is not None:
            raise ValueError("FlashAttention does not support block-sparse attention "
                             f"(blocksparse_params={blocksparse_params!r})")
        if num_kv_heads <= 0 or num_heads <= 0:
            raise ValueError(f"head counts must be positive, got num_heads={num_heads}, "
                             f"num_kv_heads={num_kv_heads}")
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA)")
        supported = FlashAttentionBackend.get_supported_head_sizes()
        if head_size not in supported:
            raise ValueError(f"Head size {head_size} is not supported by FlashAttention. "
                             f"Supported head sizes are: {supported}.")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError("Encoder self-attention and encoder/decoder cross-attention "
                                      f"are not implemented for FlashAttentionImpl (attn_type={attn_type!r})")
        if kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {kv_cache_dtype!r}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive token count, got {sliding_window}")
        if alibi_slopes is not None and len(alibi_slopes) != num_heads:
            raise ValueError(f"alibi_slopes has {len(alibi_slopes)} entries for num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.device = torch.device(device)
        self.alibi_slopes = (None if alibi_slopes is None
                             else torch.tensor(alibi_slopes, dtype=torch.float32, device=self.device))
        # FlashAttention's window is (left, right) around the query: w tokens = itself + w-1 back.
        self.sliding_window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
        self.attn_type = attn_type
        self.use_irope = use_irope
        self.dtype = dtype
        self.block_size = block_size
        spec = LayerKernelSpec(head_size, dtype, kv_cache_dtype, block_size, alibi_slopes is not None)
        self.kernel: Kernel = select_kernel(spec, self.device, kernel)
        if is_fp8_kv_cache(kv_cache_dtype) and self.kernel.name == "fa2":
            raise NotImplementedError("FlashAttention does not support fp8 kv-cache on this device "
                                      "(flash-attn 2 has no fp8 path; use kernel='fa3' or 'torch').")

    @property
    def fp8(self) -> bool:
        return is_fp8_kv_cache(self.kv_cache_dtype)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata | None,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for one layer.  query [T, H, D], key/value [T, Hk, D],
        kv_cache [2, num_blocks, block_size, Hk, D]; writes and returns ``output`` [T, H, D]."""
        if output is None:
            raise ValueError("FlashAttentionImpl.forward needs a preallocated output buffer")
        if attn_metadata is None:
            return output  # profiling run: nothing to attend over yet
        if attn_metadata.use_cascade and attn_metadata.prefix_block_table is None:
            complete_seed_cascade(attn_metadata, self.block_size)
        # Everything that could reject the call is checked before the cache is touched.
        check_forward_inputs(self, query, key, value, kv_cache, attn_metadata, output)
        n = attn_metadata.num_actual_tokens
        q, descale, scales = query[:n], {}, ()
        if self.fp8:
            kv_cache = as_fp8_cache(kv_cache)
            k_scale, v_scale, q_scale = _layer_scales(layer, query.device)
            if getattr(layer, "calculate_kv_scales", False) and not is_capturing(query):
                layer.calc_kv_scales(q, key[:n], value[:n])  # before the write that uses them
            scales = (self.kv_cache_dtype, k_scale, v_scale)
            descale = dict(k_descale=k_scale, v_descale=v_scale)
            if self.kernel.quantizes_query:
                q = fp8_query(q, q_scale)
                descale["q_descale"] = q_scale
        key_cache, value_cache = kv_cache.unbind(0)
        reshape_and_cache_flash(key[:n], value[:n], key_cache, value_cache,
                                attn_metadata.slot_mapping[:n], *scales)
        use_local = self.use_irope and attn_metadata.local_attn_metadata is not None
        common = dict(scale=self.scale, alibi_slopes=self.alibi_slopes,
                      softcap=self.logits_soft_cap, **descale)
        if use_local or not attn_metadata.use_cascade:
            if use_local:
                m = attn_metadata.local_attn_metadata
                args = dict(cu_seqlens_q=m.local_query_start_loc, max_seqlen_q=m.local_max_query_len,
                            seqused_k=m.local_seqused_k, max_seqlen_k=m.local_max_seq_len,
                            block_table=m.local_block_table, scheduler_metadata=None)
            else:
                m = attn_metadata
                args = dict(cu_seqlens_q=m.query_start_loc, max_seqlen_q=m.max_query_len,
                            seqused_k=m.seq_lens, max_seqlen_k=m.max_seq_len, num_splits=m.num_splits,
                            block_table=m.block_table, scheduler_metadata=self._scheduler_metadata(m, q.dtype))
            self.kernel.varlen_paged(q, key_cache, value_cache, output[:n], causal=True,
                                     window_size=self.sliding_window, **args, **common)
            return output
        cascade_attention(output[:n], q, key_cache, value_cache, kernel=self.kernel,
                          attn_metadata=attn_metadata, sliding_window=self.sliding_window,
                          **common)
        return output

    def _scheduler_metadata(self, m: FlashAttentionMetadata, qkv_dtype):
        """The kernel's plan for the step, built once per step and per layer shape (the seed's
        builder does it once per step; layers with different windows need their own): FA3's
        tile/split plan, or the torch kernel's cache of gather indices and masks (CPU)."""
        if not self.kernel.uses_scheduler_metadata:
            return None
        if m.scheduler_metadata is None:
            m.scheduler_metadata = {}  # the step's metadata object is shared by every layer
        # the kernel's name too: its plan is its own (FA3's tile plan, the torch kernel's cache)
        key = (self.kernel.name, self.num_heads, self.num_kv_heads, self.head_size, self.sliding_window,
               self.logits_soft_cap > 0, qkv_dtype)
        if key not in m.scheduler_metadata:
            m.scheduler_metadata[key] = self.kernel.scheduler_metadata(
                batch_size=m.num_reqs, max_seqlen_q=m.max_query_len, max_seqlen_k=m.max_seq_len,
                num_heads_q=self.num_heads, num_heads_kv=self.num_kv_heads,
                head_size=self.head_size, cache_seqlens=m.seq_lens, qkv_dtype=qkv_dtype,
                cu_seqlens_q=m.query_start_loc, page_size=self.block_size, causal=True,
                window_size=self.sliding_window, has_softcap=self.logits_soft_cap > 0,
                num_splits=m.num_splits)  # the plan and the call must agree on it
        return m.scheduler_metadata[key]


def cascade_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    kernel: Kernel,
    attn_metadata: FlashAttentionMetadata,
    scale: float,
    alibi_slopes: torch.Tensor | None,
    sliding_window: tuple[int, int],
    softcap: float,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    prefix_num_splits: int = 0,
) -> None:
    """Shared-prefix attention computed once per prefix group, merged with each request's suffix.

    Prefix pass: one row per group, non-causal over the group's shared blocks (every query of the
    group comes after its prefix).  Suffix pass: causal over each request's own blocks.  The two
    states are merged by LSE.  With one group this is exactly vLLM's cascade.  A sliding window is
    allowed only when the planner proved it never clips the prefix: then the prefix pass needs no
    window, and the suffix pass's window is exact because positions shift equally on both sides.

    ``prefix_num_splits`` (FlashAttention 3; 0 = its heuristic) splits the prefix pass's KV over
    CTAs: that pass has only a few long rows, so unsplit it leaves most SMs idle.

    The two partial outputs live in a per-device scratch (``_cascade_scratch``), not in fresh
    tensors: this path's cost at decode sizes is host time, and calls on one device must therefore
    be stream-ordered (as a worker's are).
    """
    if alibi_slopes is not None:
        raise ValueError("cascade attention does not support ALiBi (its bias needs absolute "
                         "positions, which the non-causal prefix pass does not have)")
    m = attn_metadata
    num_tokens, num_heads = query.shape[0], query.shape[1]
    prefix_out, suffix_out = _cascade_scratch(num_tokens, num_heads, value_cache.shape[-1],
                                              output.dtype, output.device)
    prefix_lse = kernel.varlen_paged(
        query, key_cache, value_cache, prefix_out, cu_seqlens_q=m.cu_prefix_query_lens,
        max_seqlen_q=num_tokens, seqused_k=m.prefix_kv_lens, max_seqlen_k=m.common_prefix_len,
        block_table=m.prefix_block_table, scale=scale, causal=False, window_size=(-1, -1),
        softcap=softcap, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
        scheduler_metadata=m.prefix_scheduler_metadata, return_lse=True,
        num_splits=prefix_num_splits)
    suffix_lse = kernel.varlen_paged(
        query, key_cache, value_cache, suffix_out, cu_seqlens_q=m.query_start_loc,
        max_seqlen_q=m.max_query_len, seqused_k=m.suffix_kv_lens, max_seqlen_k=m.max_suffix_kv_len,
        block_table=m.suffix_block_table, scale=scale, causal=True, window_size=sliding_window,
        softcap=softcap, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
        scheduler_metadata=m.suffix_scheduler_metadata, return_lse=True)
    merge_attn_states(output, prefix_out, normalize_lse(prefix_lse, num_heads, num_tokens),
                      suffix_out, normalize_lse(suffix_lse, num_heads, num_tokens))


# Token counts up to this get a kept scratch; a bigger batch's kernels dwarf one allocation.
_SCRATCH_MAX_TOKENS = 4096
_scratch_buffers: dict = {}  # (bucket, H, D, dtype, device) -> [2, bucket, H, D]
_scratch_views: dict = {}  # (tokens, H, D, dtype, device) -> its two views; slicing costs more than a lookup


def _cascade_scratch(num_tokens: int, num_heads: int, head_size: int, dtype, device):
    """Two contiguous [num_tokens, H, D] buffers for the prefix and suffix outputs.

    Buffers are kept per power-of-two token bucket and never freed or regrown, because a CUDA
    graph captured with one keeps writing to its address on every replay; a bucket first made
    during a capture comes from that graph's pool and stays valid while we hold it.  The kept
    memory is bounded by ~2x the largest bucket (4096 tokens: 64 MiB at H=32, D=128, bf16).
    """
    key = (num_tokens, num_heads, head_size, dtype, device)
    views = _scratch_views.get(key)
    if views is not None:
        return views
    if num_tokens > _SCRATCH_MAX_TOKENS:
        return torch.empty(2, num_tokens, num_heads, head_size, dtype=dtype, device=device).unbind(0)
    cap = 1 << max(num_tokens - 1, 0).bit_length()
    bkey = (cap, *key[1:])
    # A tensor made under inference_mode could never be written outside it again, and the
    # first call may come from either (graph capture runs in inference mode, eager steps not).
    with torch.inference_mode(False):
        buf = _scratch_buffers.get(bkey)
        if buf is None:
            buf = _scratch_buffers[bkey] = torch.empty(2, cap, num_heads, head_size, dtype=dtype,
                                                       device=device)
        views = _scratch_views[key] = (buf[0, :num_tokens], buf[1, :num_tokens])
    return views
