"""A GGUF file's tensors into a model's shards: dequantized (``gguf.quants.dequantize``) to float32,
then cast to the model's dtype; each rank reads and dequantizes only the rows it holds of a weight
split by rows (q/k/v, gate/up), the whole tensor of one split by columns (o_proj, down_proj), one
tensor at a time.

Names: the HF names of our families (``model.layers.{i}.self_attn.q_proj.weight``, ...) map to
llama.cpp's (``blk.{i}.attn_q.weight``) through ``gguf``'s own ``TensorNameMap``, as transformers
maps them.  Shapes: a GGUF lists dims innermost first; reversed, they are the HF shapes.

llama.cpp's converter permutes the rows of Llama's q and k weights within each head (its RoPE
pairs dims (2i, 2i+1); HF's pairs (i, i + d/2)); ``hf_rows`` undoes it by reading, for each HF row,
the GGUF row that holds it -- transformers' ``LlamaTensorProcessor._reverse_permute_weights``, per
row.  Qwen2/Qwen3 converters do not permute.
"""

from __future__ import annotations

import numpy as np
import torch

from ray_attn import gguf_file
from ray_attn.model import gguf_q4
from ray_attn.model.layers import FusedShard, Shard

# The HF module names of the families a GGUF may hold (gguf_file.GGUF_ARCHITECTURES), each with a
# .weight (and, for Qwen2's q/k/v, a .bias).
_GLOBAL = ("model.embed_tokens", "model.norm", "lm_head")
_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
          "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Rows llama.cpp permutes, by GGUF tensor-name part, and the metadata key of their head count.
_PERMUTED = {".attn_q.": "attention.head_count", ".attn_k.": "attention.head_count_kv"}


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def gguf_to_hf_names(path: str) -> dict[str, str]:
    """GGUF tensor name -> HF name, for every tensor of the file our families have a name for."""
    import gguf

    reader = gguf_file.reader(path)
    arch_name = gguf_file.architecture(path)
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    n_layers = int(_field(reader, f"{arch_name}.block_count") or 0)
    name_map = gguf.get_tensor_name_map(arch, n_layers)
    hf_modules = list(_GLOBAL) + [f"model.layers.{i}.{m}" for i in range(n_layers) for m in _LAYER]
    out = {}
    for module in hf_modules:
        g = name_map.get_name(module)
        if g is not None:
            for suffix in (".weight", ".bias"):
                out[g + suffix] = module + suffix
    present = {t.name for t in reader.tensors}
    return {g: h for g, h in out.items() if g in present}


def checkpoint_names(path: str) -> list[str]:
    """The file's tensors by HF name (a tensor with none keeps its GGUF name, so that the loader
    reports it as one the model does not use)."""
    names = gguf_to_hf_names(path)
    return [names.get(t.name, t.name) for t in gguf_file.reader(path).tensors]


def tensors_by_hf_name(path: str) -> dict:
    """The file's ``ReaderTensor``s by HF name (by GGUF name where it has none)."""
    hf_of = gguf_to_hf_names(path)
    return {hf_of.get(t.name, t.name): t for t in gguf_file.reader(path).tensors}


def hf_shape(tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def hf_rows(path: str, tensor, rows: np.ndarray) -> np.ndarray:
    """The GGUF rows that hold HF rows ``rows`` of ``tensor`` (a permutation within each head for
    Llama's q and k, the identity otherwise)."""
    arch = gguf_file.architecture(path)
    key = next((k for part, k in _PERMUTED.items() if part in f".{tensor.name}"), None)
    if arch != "llama" or key is None:
        return rows
    n_head = int(_field(gguf_file.reader(path), f"{arch}.{key}"))
    half = hf_shape(tensor)[0] // n_head // 2
    head, within = np.divmod(rows, 2 * half)
    j, k = np.divmod(within, half)  # HF row (head, j, k) sits at GGUF row (head, k, j)
    return head * 2 * half + 2 * k + j


def read_rows(path: str, t, rows: np.ndarray | None = None) -> torch.Tensor:
    """HF rows ``rows`` (all when None) of GGUF tensor ``t`` (a ``ReaderTensor`` of the file),
    dequantized to float32 [len(rows), ...]."""
    from gguf.quants import dequantize

    shape = hf_shape(t)
    if len(shape) > 2:
        raise ValueError(f"{path}: tensor {t.name!r} has {len(shape)} dims; only 1-D and 2-D tensors load")
    data = t.data
    if len(shape) == 2:
        if rows is None:
            rows = np.arange(shape[0])
        data = data[hf_rows(path, t, rows)]  # a copy of just these rows' (quantized) bytes
    out = np.asarray(dequantize(data, t.tensor_type), dtype=np.float32)
    if not out.flags.writeable:  # F32 rows are a view of the read-only memory map
        out = out.copy()
    return torch.from_numpy(out.reshape((len(rows),) + shape[1:] if len(shape) == 2 else shape))


def load_gguf(shards: dict[str, Shard | FusedShard], path: str, *, tied: bool = False,
              architecture: str = "model") -> None:
    """Copy each shard's slice of its GGUF tensor in; every check runs before any copy."""
    tensors = tensors_by_hf_name(path)
    missing = [n for n in shards if n not in tensors]
    if missing:
        raise ValueError(f"GGUF {path!r} lacks {len(missing)} tensor(s) the model needs: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    extra = [f"{n} ({t.name})" if n != t.name else n for n, t in tensors.items()
             if n not in shards and not (tied and n == "lm_head.weight")]
    if extra:
        raise ValueError(f"GGUF {path!r} has {len(extra)} tensor(s) this {architecture} does not use: "
                         f"{', '.join(extra[:8])}")
    for n, shard in shards.items():
        got = hf_shape(tensors[n])
        if got != tuple(shard.full_shape):
            raise ValueError(f"GGUF tensor {tensors[n].name!r} ({n}) has shape {got}, but the model config "
                             f"expects {tuple(shard.full_shape)}")
        if shard.dtype is not None:
            raise ValueError(f"{n}: GGUF weights dequantize to float; stored-FP8 quantization cannot load them")
    for n, shard in shards.items():
        pieces = shard.pieces()
        if len(shard.full_shape) == 1:
            full = read_rows(path, tensors[n])
            for piece in pieces:
                piece.dest.copy_(full[piece.index()])
            continue
        # The rows any piece takes (all of them for a weight split by columns), read once.
        spans = [piece.index()[0] if piece.index() else slice(None) for piece in pieces]
        rows = np.unique(np.concatenate([np.arange(shard.full_shape[0])[s] for s in spans]))
        block = read_rows(path, tensors[n], rows)
        for piece, span in zip(pieces, spans):
            at = np.searchsorted(rows, np.arange(shard.full_shape[0])[span])
            local = block[torch.from_numpy(at)] if len(at) != len(rows) else block
            piece.dest.copy_(local[(slice(None),) + tuple(piece.index()[1:])])
        del block


# -- quantization='gguf': each rank's slice of the Q4 weights packed as stored (model/gguf_q4.py) --
def _row_offset(dest: torch.Tensor, base: torch.Tensor) -> int:
    return (dest.data_ptr() - base.data_ptr()) // (base.stride(0) * base.element_size())


def pack_q4(model, checkpoint: str) -> int:
    """Pack every 2-D weight of ``model`` whose pieces all come from Q4_0 / Q4_1 tensors of the GGUF
    ``checkpoint`` (a file, or a folder of one); returns how many.  CPU ranks only (GPU ranks keep
    the dense weights)."""
    path = gguf_file.gguf_path(checkpoint)
    if model.device.type != "cpu" or not gguf_q4.available():
        gguf_q4.log.warning("quantization='gguf' runs the 4-bit blocks on CPU ranks only; this rank (%s) "
                            "runs the dequantized weights", model.device)
        return 0
    tensors = tensors_by_hf_name(path)
    G = gguf_q4.GROUP
    params: dict[int, gguf_q4.Blocks] = {}
    for name, shard in model.weight_shards().items():
        t = tensors.get(name)
        for piece in shard.pieces():
            dest = piece.dest
            base = dest._base if dest._base is not None else dest
            if dest.dim() != 2 or base.dim() != 2 or len(piece.full_shape) != 2:
                continue
            if base is model.embed_tokens and model.lm_head is not base:
                continue  # looked up, never multiplied: its packed copy would be memory for nothing
            p = params.setdefault(id(base), gguf_q4.Blocks(base))
            idx = piece.index()
            cols = idx[1] if len(idx) > 1 else slice(0, piece.full_shape[1])
            start, stop = cols.start or 0, cols.stop if cols.stop is not None else piece.full_shape[1]
            if t is None or t.tensor_type.name not in gguf_q4.BLOCK_BYTES or start % G or stop % G:
                p.ok = False
                continue
            rows = np.arange(piece.full_shape[0])[idx[0]]
            codes, scale, zero = gguf_q4.q4_blocks(t, hf_rows(path, t, rows))
            r0 = _row_offset(dest, base)
            at = slice(r0, r0 + len(rows))
            p.codes[at] = codes[:, start:stop]
            p.scale[at] = scale[:, start // G:stop // G]
            p.zero[at] = zero[:, start // G:stop // G]
            p.filled[at] = True
    done = 0
    for p in params.values():
        if p.ok and p.filled.all():
            p.pack()
            done += 1
    gguf_q4.log.info("quantization='gguf': %d weights run on their 4-bit blocks (%s)", done, path)
    return done
