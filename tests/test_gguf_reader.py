"""``ray_attn.gguf_reader.FastGGUFReader`` against gguf's own ``GGUFReader``: every field and
tensor the same, part by part (dtype, shape, bytes), on a file with every metadata kind and on the
embedded SmolLM2 GGUF; a truncated file is an error, never a short read."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ray_attn.gguf_reader import FastGGUFReader  # noqa: E402


def assert_same(path):
    stock, fast = gguf.GGUFReader(path), FastGGUFReader(path)
    assert list(fast.fields) == list(stock.fields)
    for name, a in stock.fields.items():
        b = fast.fields[name]
        assert (b.offset, b.name, b.types, b.data) == (a.offset, a.name, a.types, a.data), name
        assert len(b.parts) == len(a.parts), name
        for i, (pa, pb) in enumerate(zip(a.parts, b.parts)):
            assert (pb.dtype, pb.shape) == (pa.dtype, pa.shape), (name, i)
            assert pb.tobytes() == pa.tobytes(), (name, i)
        assert b.contents() == a.contents(), name
    assert fast.data_offset == stock.data_offset
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in fast.tensors] == \
           [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in stock.tensors]
    for ta, tb in zip(stock.tensors, fast.tensors):
        assert np.array_equal(np.asarray(ta.data), np.asarray(tb.data)), ta.name
    return fast


def write_every_kind(path, rng):
    w = gguf.GGUFWriter(str(path), "llama")
    words = ["", "a", "héllo", "Ġthe", "\u2581x" * 9, "<|im_end|>"] + [f"t{i}" for i in rng.integers(0, 10**6, 40)]
    w.add_array("test.strings", words)
    w.add_array("test.ints", [int(x) for x in rng.integers(-2**31, 2**31 - 1, 33)])
    w.add_array("test.floats", [float(x) for x in rng.standard_normal(17)])
    w.add_array("test.bools", [bool(x) for x in rng.integers(0, 2, 9)])
    w.add_array("test.nested", [[1, 2], [3]])  # the stock walk
    w.add_string("test.string", "plain")
    w.add_uint64("test.u64", 2**40 + 3)
    w.add_float32("test.f32", 0.25)
    w.add_bool("test.bool", True)
    w.add_tensor("x", rng.standard_normal((4, 8)).astype(np.float32))
    w.add_tensor("y", rng.standard_normal(5).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_metadata_kind_reads_as_the_stock_reader_does(tmp_path):
    path = tmp_path / "kinds.gguf"
    write_every_kind(path, np.random.default_rng())
    fast = assert_same(str(path))
    assert fast.fields["test.strings"].contents()[:3] == ["", "a", "héllo"]


def test_the_embedded_model_reads_as_the_stock_reader_does():
    from ray_attn.presets import default_gguf

    try:
        path = default_gguf()
    except FileNotFoundError:  # pragma: no cover - `make install` installs it
        pytest.skip("the embedded model is not installed")
    fast = assert_same(path)
    assert len(fast.fields["tokenizer.ggml.tokens"].data) == 49152


@pytest.mark.parametrize("cut", [0.5, 0.9])
def test_a_truncated_file_is_an_error(tmp_path, cut):
    path = tmp_path / "kinds.gguf"
    write_every_kind(path, np.random.default_rng(0))
    raw = path.read_bytes()
    # inside the metadata: the strings array sits early in it
    short = tmp_path / "short.gguf"
    short.write_bytes(raw[:int(len(raw) * cut * 0.5)])
    with pytest.raises((IndexError, ValueError)):
        FastGGUFReader(str(short))
