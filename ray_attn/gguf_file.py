"""GGUF checkpoints (llama.cpp's one-file format), read as vLLM reads them: the model's config,
its tokenizer and chat template from the file's metadata through transformers' GGUF support, its
tensors through the ``gguf`` package (``ray_attn.model.gguf_weights`` loads them).

A checkpoint path names a GGUF when it is a file, or a folder without config.json that holds one
``.gguf``.  Everything a worker could not load -- an architecture we do not serve, a tensor type
``gguf`` cannot dequantize, a file that is not a GGUF -- is refused here, by name, when the
driver validates the config: before any actor starts.

Reading a GGUF's metadata is slow (gguf's ``GGUFReader`` walks every token of the vocabulary:
3.3 s for SmolLM2's 49k on the AMD VM), so files are opened through ``gguf_reader``'s faster one
(0.25 s), a process reads each file once (``reader``, ``gguf_fields``), and the config comes from
that reader (``transformers_config``), not from a second one inside transformers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

from ray_attn import hf_config

SUFFIX = ".gguf"
# general.architecture -> the family that serves it.  llama.cpp writes Mistral as "llama" too
# (transformers then reads it as "mistral" from general.name; both run our Llama family).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Tensors llama.cpp writes that change what the model computes and that we do not implement.
REFUSED_TENSORS = {"rope_freqs.weight": "Llama 3.1 RoPE frequency factors"}


def gguf_path(checkpoint: str) -> str | None:
    """The GGUF file ``checkpoint`` names, or None for an HF-format folder.  A ``.gguf`` path that
    does not exist, or a folder of several ``.gguf`` files, is an error naming them."""
    if os.path.isdir(checkpoint):
        if os.path.isfile(os.path.join(checkpoint, "config.json")):
            return None  # HF format (a .gguf beside it is not what the folder's config describes)
        found = sorted(f for f in os.listdir(checkpoint) if f.lower().endswith(SUFFIX))
        if len(found) > 1:
            raise ValueError(f"checkpoint folder {checkpoint!r} holds {len(found)} GGUF files ({', '.join(found)}); "
                             "name the one to serve")
        return os.path.join(checkpoint, found[0]) if found else None
    if os.path.isfile(checkpoint):
        return checkpoint
    if checkpoint.lower().endswith(SUFFIX):
        raise FileNotFoundError(f"GGUF checkpoint {checkpoint!r} does not exist")
    return None


def _identity(path: str) -> tuple:
    st = os.stat(path)
    return os.path.realpath(path), st.st_size, st.st_mtime_ns  # a rewritten file is read again


def reader(path: str):
    """The file's ``gguf.GGUFReader`` (memory-mapped; one per process and file)."""
    return _reader(*_identity(path))


@functools.lru_cache(maxsize=4)
def _reader(path: str, size: int, mtime: int):
    from ray_attn.gguf_reader import FastGGUFReader

    try:
        return FastGGUFReader(path)
    except Exception as e:  # bad magic (ValueError), truncated (IndexError, struct / mmap errors)
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


@functools.lru_cache(maxsize=None)
def dequantizable_types() -> frozenset[str]:
    """The tensor types (``GGMLQuantizationType`` names) ``gguf.quants.dequantize`` implements:
    found by dequantizing one zero block of each, so a newer ``gguf`` brings its new types."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    ok = set()
    for qtype in GGMLQuantizationType:
        _, type_size = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros((1, type_size), np.uint8), qtype)
        except (NotImplementedError, ValueError, TypeError):
            continue
        ok.add(qtype.name)
    return frozenset(ok)


def architecture(path: str) -> str:
    """The file's ``general.architecture`` (llama.cpp's name: "llama", "qwen2", ...)."""
    field = reader(path).fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path}: GGUF metadata lacks general.architecture")
    return field.contents()


def check_servable(path: str) -> None:
    """Refuse, by name, a GGUF whose architecture or tensors no worker could load."""
    arch = architecture(path)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)} (llama covers Mistral)")
    ok = dequantizable_types()
    bad = [f"{t.name} ({t.tensor_type.name})" for t in reader(path).tensors if t.tensor_type.name not in ok]
    if bad:
        raise ValueError(f"{path}: {len(bad)} tensor(s) of a type gguf cannot dequantize: {', '.join(bad[:4])}"
                         f"{' ...' if len(bad) > 4 else ''}; supported types: {', '.join(sorted(ok))}")
    for t in reader(path).tensors:
        if t.name in REFUSED_TENSORS:
            raise ValueError(f"{path}: tensor {t.name!r} ({REFUSED_TENSORS[t.name]}) is not supported")


def hf_config_dict(path: str) -> dict:
    """The HF config transformers reads from the file's metadata, with its ``architectures``."""
    return dict(_hf_config_dict(*_identity(path)))


@functools.lru_cache(maxsize=4)
def _hf_config_dict(path: str, size: int, mtime: int) -> dict:
    hf = transformers_config(reader(path))
    model_type = hf.get("model_type")
    if model_type not in hf_config.MODEL_TYPES:
        raise ValueError(f"{path}: GGUF model_type {model_type!r} is not supported")
    hf["architectures"] = [hf_config.MODEL_TYPES[model_type]]
    return hf


def transformers_config(r) -> dict:
    """The config ``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`` builds from a
    reader's metadata -- its own key tables and value parser, its renames, for the families of
    ``GGUF_ARCHITECTURES`` -- read from this process's one reader instead of a second one, and
    without parsing the vocabulary (the cost of transformers' call: ~4 s for SmolLM2).
    tests/model/test_gguf.py checks it equals transformers' own."""
    from transformers.integrations import _gguf_parse_value
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    def value(field):
        v = [_gguf_parse_value(field.parts[i], field.types) for i in field.data]
        return v[0] if len(v) == 1 else v

    tables = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    arch = value(r.fields["general.architecture"])
    name = [value(r.fields["general.name"])] if "general.name" in r.fields else []
    # transformers' rename: llama.cpp writes Mistral as llama (its test: an exact name "mistral")
    renamed = "mistral" if "llama" in arch and "mistral" in name else arch
    config = {"tie_word_embeddings": all(t.name != "output.weight" for t in r.tensors)}
    for key, field in r.fields.items():
        prefix, _, rest = key.replace(arch, renamed).partition(".")
        target = tables.get(prefix, {}).get(rest)
        if target is None or target == -1:
            continue
        v = value(field)
        config[target] = v.replace(arch, renamed) if isinstance(v, str) and arch in v else v
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in r.fields:
        config["vocab_size"] = len(r.fields["tokenizer.ggml.tokens"].data)
    return config


def gguf_fields(path: str) -> dict:
    """``ModelConfig`` fields of a GGUF checkpoint.  ``dtype`` is float32: a GGUF holds no compute
    dtype, and its weights dequantize to float32 exactly (give model.dtype to run another)."""
    check_servable(path)
    return hf_config.fields_from_hf(hf_config_dict(path), path) | {"dtype": "float32"}


def load_tokenizer(path: str):
    """The tokenizer (with its chat template) transformers builds from the GGUF's metadata.

    transformers builds it by walking the vocabulary and merges in the metadata (~4.5 s for
    SmolLM2's 49k tokens on two cores), which every Serve replica, demo and script paid again.
    So the first build is saved (``save_pretrained``) under ``tokenizer_cache_dir()``, keyed by
    the file's path, size and mtime and transformers' version, and later loads read that folder
    (~0.2 s).  A cache that cannot be written is skipped, never an error."""
    from transformers import AutoTokenizer

    cached = _cached_tokenizer_dir(path)
    if cached is not None and os.path.isfile(os.path.join(cached, _COMPLETE)):
        try:
            return AutoTokenizer.from_pretrained(cached, local_files_only=True, trust_remote_code=False)
        except Exception:  # a damaged entry: rebuilt from the file below
            pass
    folder, name = os.path.split(os.path.abspath(path))
    with _transformers_reading():
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True, trust_remote_code=False)
    if cached is not None:
        _save_tokenizer(tok, cached)
    return tok


def hf_causal_lm(path: str, dtype=None):
    """HF transformers' own model from the GGUF (``AutoModelForCausalLM`` with ``gguf_file``), the
    reference the demo, the tests and the scripts compare against, in ``dtype`` (float32 unset)."""
    import torch
    import transformers

    folder, name = os.path.split(os.path.abspath(path))
    with _transformers_reading():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                                  dtype=dtype or torch.float32)
    return model.eval()


_SWAP_LOCK = threading.RLock()


@contextlib.contextmanager
def _transformers_reading():
    """While transformers reads a GGUF: its ``GGUFReader`` is ours, one per file, and gguf's
    tensor-name map is cached.

    transformers parses the file's header twice for a model (config, then weights) and once more
    for a tokenizer, with the stock reader (3.3 s for SmolLM2 on the AMD VM; ``gguf_reader``'s
    0.25), and rebuilds the name map once for each of the model's modules.  It only reads the
    reader and the map, so what it computes is unchanged.  gguf's module attributes are swapped
    for the call (transformers imports both from the package inside its loader, at each call)."""
    import gguf

    from ray_attn.gguf_reader import FastGGUFReader

    readers = {}

    def reader(file, *args, **kwargs):
        key = (os.path.abspath(str(file)), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = FastGGUFReader(file, *args, **kwargs)
        return readers[key]

    with _SWAP_LOCK:  # two threads swapping at once would leave the other's reader in place
        stock_reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = stock_reader, name_map


_COMPLETE = "ray_attn_complete"  # written last: a folder without it is a save that did not finish


def tokenizer_cache_dir() -> str | None:
    """Where converted GGUF tokenizers are kept: ``RAY_ATTN_CACHE_DIR`` (``0`` or empty: no
    cache), else ``$XDG_CACHE_HOME/ray_attn`` or ``~/.cache/ray_attn``; ``/tokenizers`` below it."""
    root = os.environ.get("RAY_ATTN_CACHE_DIR")
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "ray_attn")
    elif root in ("", "0"):
        return None
    return os.path.join(root, "tokenizers")


def _cached_tokenizer_dir(path: str) -> str | None:
    import hashlib

    import transformers

    root = tokenizer_cache_dir()
    if root is None:
        return None
    real, size, mtime = _identity(path)
    key = hashlib.sha256(f"{real}\0{size}\0{mtime}\0{transformers.__version__}".encode()).hexdigest()[:24]
    return os.path.join(root, f"{os.path.basename(real)}-{key}")


def _save_tokenizer(tok, target: str) -> None:
    """Save into a fresh folder beside ``target``, then rename it into place: a reader never sees
    half a save, and of two processes saving at once one rename wins and the other is dropped."""
    import shutil
    import tempfile

    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(target))
    except OSError:
        return
    try:
        tok.save_pretrained(tmp)
        open(os.path.join(tmp, _COMPLETE), "w").close()
        shutil.rmtree(target, ignore_errors=True)  # an entry without its marker
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
