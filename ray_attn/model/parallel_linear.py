"""The tensor-parallel linears: each rank keeps its slice of the weight (``ColumnParallelLinear``
cuts the output rows, ``RowParallelLinear`` the input columns and all-reduces the partial sums),
in the model dtype or as FP8 (``Fp8Linear``; the math and kernels are ``ray_attn.model.fp8``'s).
Each slice is described by a ``layers.Shard``, so loading and seeded random init cut it alike."""

from __future__ import annotations

import torch
from torch import nn

from ray_attn.model import fp8, gemv
from ray_attn.model.gemv import linear
from ray_attn.model.layers import BroadcastShard, FusedShard, Shard, new_param
from ray_attn.model.quantization import Fp8Config
from ray_attn.model.tp import TPGroup


F8 = "F8_E4M3"  # safetensors' name of float8_e4m3fn


def _blocks(n: int, b: int = 128) -> int:
    return -(-n // b)


class Fp8Linear(nn.Module):
    """What the parallel linears share to hold FP8 weights (``quantize_``; see
    ``ray_attn.model.fp8`` for the math and the kernels).

    Scales, once loaded: ``weight_scale`` float32, one per output row [N] (per-channel
    checkpoints; per-tensor ones too, each part's scale repeated over its rows -- exact, where
    vLLM requantizes fused parts to their largest scale, and one kernel then serves both), or one
    per 128 x 128 block [ceil(N/128), ceil(K/128)] (the checkpoint's ``weight_scale_inv``);
    ``input_scale`` [1] for static activations: the largest of the fused parts' (they see the
    same input, so calibration gives them the same scale; the largest clips none of them).
    Online quantization keeps the loaded weight in the model dtype until
    ``process_weights_after_loading``."""

    scheme: Fp8Config | None = None
    name: str = ""
    # ray_attn.lora.layers.LoRALinear: this layer's adapter slots, added to its output when set
    lora = None

    def _quantize(self, scheme: Fp8Config, name: str, num_parts: int, scale_rows: int, k: int) -> None:
        self.scheme, self.name = scheme, name
        N, dev = self.weight.shape[0], self.weight.device
        if not scheme.is_checkpoint_fp8_serialized:
            return  # weights load in the model dtype; quantized after loading
        self.weight = new_param(N, k, dtype=fp8.FP8_DTYPE, device=dev)
        shape = (scale_rows, _blocks(k)) if scheme.weight_strategy == "block" else (N,)
        self.weight_scale = new_param(*shape, dtype=torch.float32, device=dev)
        if scheme.activation_scheme == "static":
            self.input_scale_parts = new_param(num_parts, dtype=torch.float32, device=dev)
            self.input_scale = new_param(1, dtype=torch.float32, device=dev)

    def _block_check(self, what: str, full: int, start: int, size: int, last: bool) -> None:
        """A slice of a block-quantized tensor must start on a 128-block and hold whole blocks,
        but for a last slice that ends the tensor (its ragged last block)."""
        if start % 128 or (size % 128 and not (last and start + size == full)):
            raise ValueError(f"{self.name}: {what} slice [{start}, {start + size}) of {full} does not fall on "
                             f"128-blocks of weight_block_size {list(self.scheme.weight_block_size)}; choose a "
                             "tensor_parallel_size whose shards are multiples of 128")

    def _companions(self, i: int, full_rows: int, start: int, rows: int, offset: int, block_offset: int,
                    dim: int = 0) -> dict:
        """This weight piece's scale tensors, by checkpoint suffix."""
        sc = self.scheme
        if sc is None or not sc.is_checkpoint_fp8_serialized:
            return {}
        if sc.weight_strategy == "block":
            k_full = self.full_in if dim == 1 else self.weight.shape[1]
            n = self.weight_scale.shape[0] if dim == 1 else _blocks(rows)
            dest = self.weight_scale[block_offset:block_offset + n]
            full = (_blocks(full_rows), _blocks(k_full))
            out = {sc.scale_name: Shard(dest, full, dim, start // 128)}
        elif sc.weight_strategy == "channel":
            out = {sc.scale_name: Shard(self.weight_scale[offset:offset + rows].view(rows, 1), (full_rows, 1), 0,
                                        0 if dim == 1 else start)}
        else:
            out = {sc.scale_name: BroadcastShard(self.weight_scale[offset:offset + rows], (1,))}
        if sc.activation_scheme == "static":
            out["input_scale"] = BroadcastShard(self.input_scale_parts[i:i + 1], (1,))
        return out

    def process_weights_after_loading(self) -> None:
        sc = self.scheme
        if sc is None:
            return
        if not sc.is_checkpoint_fp8_serialized:
            if self.weight.dtype == fp8.FP8_DTYPE:
                return  # already quantized (a second load)
            q, scale = fp8.online_quantize(self.weight.data, self.tp if isinstance(self, RowParallelLinear) else None)
            self.weight = nn.Parameter(q, requires_grad=False)
            self.weight_scale = nn.Parameter(scale, requires_grad=False)
        elif sc.activation_scheme == "static":
            self.input_scale.data.copy_(self.input_scale_parts.data.amax().view(1))

    def wants_fp8_input(self, x: torch.Tensor) -> bool:
        """Whether the kernel that makes x [..., K] should quantize it for this layer (``quant=``
        of ``fused.rms_norm`` / ``silu_mul``): the quantizer launch then fuses into that kernel."""
        return fp8.wants_quantized_input(x, self.weight, self.scheme)

    def _linear(self, x, bias: torch.Tensor | None) -> torch.Tensor:
        if self.scheme is None:
            return linear(fp8.plain(x), self.weight, bias)
        if self.weight.dtype != fp8.FP8_DTYPE:
            raise RuntimeError(f"{self.name}: FP8 weights are quantized when they load; load or init them first")
        return fp8.apply_fp8_linear(x, self.weight, self.weight_scale, self.scheme, getattr(self, "input_scale", None),
                                    bias)


class ColumnParallelLinear(Fp8Linear):
    """y = x W^T (+ b), W's rows split over ranks.  ``parts`` (full_rows, start, rows) stacks
    several checkpoint tensors (q/k/v, gate/up) into one local weight so one matmul serves them
    all; a bias is cut the same way, each part's piece following its rows (and so are an FP8
    weight's scales)."""

    def __init__(self, in_features: int, parts: list[tuple[int, int, int]], *, bias: bool = False,
                 dtype, device):
        super().__init__()
        self.parts = parts
        self.sizes = [rows for _, _, rows in parts]
        self.weight = new_param(sum(self.sizes), in_features, dtype=dtype, device=device)
        self.bias = new_param(sum(self.sizes), dtype=dtype, device=device) if bias else None

    def quantize_(self, scheme: Fp8Config, name: str) -> None:
        """Hold this layer's weight in FP8 (``name``: the layer, for errors)."""
        self.scheme, self.name = scheme, name
        if scheme.weight_strategy == "block":
            for i, (full, start, rows) in enumerate(self.parts):
                self._block_check(f"part {i} (rows)", full, start, rows, i == len(self.parts) - 1)
        self._quantize(scheme, name, len(self.parts), sum(map(_blocks, self.sizes)), self.weight.shape[1])

    def shard(self, i: int) -> Shard:
        full_rows, start, rows = self.parts[i]
        offset = sum(self.sizes[:i])
        comp = self._companions(i, full_rows, start, rows, offset, sum(map(_blocks, self.sizes[:i])))
        return Shard(self.weight[offset:offset + rows], (full_rows, self.weight.shape[1]), 0, start,
                     dtype=F8 if comp else None, companions=comp)

    def bias_shard(self, i: int) -> Shard:
        """Part ``i``'s bias: the same rows of the checkpoint's bias as ``shard(i)`` takes of its
        weight (a replicated KV head's rows on every rank that holds it)."""
        full_rows, start, rows = self.parts[i]
        offset = sum(self.sizes[:i])
        return Shard(self.bias[offset:offset + rows], (full_rows,), 0, start, init="bias")

    def fused_shard(self) -> FusedShard:
        """The whole weight as pieces of one checkpoint tensor stacking every part's full rows
        (and its scales as pieces of the checkpoint's scales of that tensor)."""
        full = (sum(full_rows for full_rows, _, _ in self.parts), self.weight.shape[1])
        before = [sum(full_rows for full_rows, _, _ in self.parts[:i]) for i in range(len(self.parts))]
        pieces = [self.shard(i) for i in range(len(self.parts))]
        out = FusedShard([Shard(s.dest, full, 0, before[i] + s.start) for i, s in enumerate(pieces)], full,
                         dtype=pieces[0].dtype)
        sc = self.scheme
        if pieces[0].companions:
            name = sc.scale_name
            if sc.weight_strategy == "tensor":  # one scale for the fused tensor: every row's
                out.companions[name] = BroadcastShard(self.weight_scale, (1,))
            else:
                if sc.weight_strategy == "block" and any(b % 128 for b in before):
                    raise ValueError(f"{self.name}: fused parts of {before} rows do not fall on 128-blocks")
                div = 128 if sc.weight_strategy == "block" else 1
                fs = tuple(pieces[0].companions[name].full_shape)
                fs = (_blocks(full[0]) if div == 128 else full[0],) + fs[1:]
                out.companions[name] = FusedShard([Shard(p.companions[name].dest, fs, 0, (before[i] + p.start) // div)
                                                   for i, p in enumerate(pieces)], fs)
            if sc.activation_scheme == "static":
                out.companions["input_scale"] = BroadcastShard(self.input_scale_parts, (1,))
        return out

    def forward(self, x) -> torch.Tensor:
        if self.lora is None:
            return self._linear(x, self.bias)
        return self.lora(fp8.plain(x), lambda: self._linear(x, self.bias))


class RowParallelLinear(Fp8Linear):
    """y = sum over ranks of x_r W_r^T: W's columns split; the partial sums are all-reduced.  FP8
    per-row scales are the full rows' (replicated); block scales are cut along K with the weight."""

    def __init__(self, full_in: int, out_features: int, start: int, cols: int, tp: TPGroup, *,
                 dtype, device):
        super().__init__()
        self.full_in, self.start, self.tp = full_in, start, tp
        self.weight = new_param(out_features, cols, dtype=dtype, device=device)

    def quantize_(self, scheme: Fp8Config, name: str) -> None:
        self.scheme, self.name = scheme, name
        if scheme.weight_strategy == "block":
            self._block_check("input (columns)", self.full_in, self.start, self.weight.shape[1], True)
        self._quantize(scheme, name, 1, _blocks(self.weight.shape[0]), self.weight.shape[1])

    def shard(self) -> Shard:
        N = self.weight.shape[0]
        comp = self._companions(0, N, self.start, N, 0, 0, dim=1)
        return Shard(self.weight, (N, self.full_in), 1, self.start, dtype=F8 if comp else None, companions=comp)

    def forward(self, x) -> torch.Tensor:
        if self.lora is None:
            return self.tp.all_reduce(self._linear(x, None))
        # the rank's partial update joins the partial sum before the reduce
        return self.tp.all_reduce(self.lora(fp8.plain(x), lambda: self._linear(x, None)))

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """``forward(silu_mul(gate_up))`` with the product made inside the linear's kernel: bf16
        weights at one row (the GEMV; 2-16 rows in the skinny kernel when opted in), FP8 ones where
        the dispatch runs them weight-only (``w8a16``); no adapter: LoRA needs the product
        itself.  None where no such kernel serves."""
        if self.lora is not None:
            return None
        if self.scheme is None:
            y = gemv.linear_silu_mul(gate_up, self.weight)
            return None if y is None else self.tp.all_reduce(y)
        if not (gemv.silu_mul_input_ok(gate_up, self.weight) and self.weight.dtype == fp8.FP8_DTYPE
                and fp8.select_fp8_kernel(gate_up[:, :self.weight.shape[1]], self.weight, self.scheme) == "w8a16"):
            return None
        return self.tp.all_reduce(gemv.gemv(gate_up, self.weight, silu_mul=True,
                                            w_scale=self.weight_scale.float().contiguous()))


def qkv_parts(num_heads: int, num_kv_heads: int, head_size: int, rank: int, size: int
              ) -> tuple[list[tuple[int, int, int]], int, int]:
    """This rank's (full_rows, start, rows) of q, k and v, and its (query heads, kv heads)."""
    if num_heads % size:
        raise ValueError(f"tp_size={size} must divide num_attention_heads={num_heads}")
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(f"tp_size={size} must divide num_key_value_heads={num_kv_heads}")
        hk, kv_first = num_kv_heads // size, rank * (num_kv_heads // size)
    else:
        if size % num_kv_heads:
            raise ValueError(f"num_key_value_heads={num_kv_heads} must divide tp_size={size}")
        hk, kv_first = 1, rank // (size // num_kv_heads)
    h = num_heads // size
    D = head_size
    kv = (num_kv_heads * D, kv_first * D, hk * D)
    return [(num_heads * D, rank * h * D, h * D), kv, kv], h, hk


def qkv_parallel(hidden: int, num_heads: int, num_kv_heads: int, head_size: int, tp: TPGroup, *,
                 bias: bool = False, dtype, device) -> tuple[ColumnParallelLinear, int, int]:
    """The fused q/k/v projection of this rank (with q/k/v biases when ``bias``), and its
    (query heads, kv heads).

    With fewer KV heads than ranks each KV head is replicated on ``tp // num_kv_heads`` ranks.
    """
    parts, h, hk = qkv_parts(num_heads, num_kv_heads, head_size, tp.rank, tp.size)
    return ColumnParallelLinear(hidden, parts, bias=bias, dtype=dtype, device=device), h, hk


def check_fp8_tp_slices(config, tp_size: int) -> None:
    """Refuse, naming the projection, a TP size whose slices of a block-quantized model's linear
    layers fall off 128-blocks: the layers' own checks (run when a rank builds its shard), made
    on the driver for every rank before any actor starts.  ``config``: a ModelConfig."""
    from ray_attn.model.quantization import parse_quantization

    scheme = parse_quantization(config.quantization)
    if scheme is None or scheme.weight_strategy != "block":
        return
    H, D, I = config.num_attention_heads, config.head_size, config.intermediate_size
    gated = config.architecture != "MptForCausalLM"
    meta = dict(dtype=torch.float32, device="meta")
    for rank in range(tp_size):
        parts, h, _ = qkv_parts(H, config.num_key_value_heads, D, rank, tp_size)
        tp = TPGroup(rank, tp_size, group=object())  # arithmetic only: nothing reduces over it
        n = I // tp_size
        for name, layer in (
                ("self_attn.qkv_proj (q, k, v)", ColumnParallelLinear(config.hidden_size, parts, **meta)),
                ("self_attn.o_proj", RowParallelLinear(H * D, config.hidden_size, rank * h * D, h * D, tp, **meta)),
                ("mlp.gate_up (gate, up)", ColumnParallelLinear(config.hidden_size, [(I, rank * n, n)] * (1 + gated),
                                                                **meta)),
                ("mlp.down_proj", RowParallelLinear(I, config.hidden_size, rank * n, n, tp, **meta))):
            layer.quantize_(scheme, f"tensor_parallel_size={tp_size} rank {rank}: {name}")
