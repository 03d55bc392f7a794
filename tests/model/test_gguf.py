"""GGUF checkpoints: small GGUFs of random HF models (``gguf``'s own writer, as llama.cpp's converter
writes them; tests/model/gguf_fixture.py) load into our families at every TP slice with exactly
the weights transformers dequantizes from the same file, and the engine's greedy tokens equal HF
transformers' on it.  A file no worker could load is refused on the driver, by name.

Tolerances: the loaded weights are compared exactly (both sides run ``gguf.quants.dequantize``
to float32; ours then undoes llama.cpp's q/k row permutation per row, transformers per tensor).
Greedy tokens are compared exactly in float32 (logits differ by ~1e-6 between the two, from
summation order; the random models' top two logits are far further apart than that).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_attn.config import CacheConfig, EngineConfig, ParallelConfig
from ray_attn.model import build_model
from tests.model.gguf_fixture import tiny_hf, write_gguf

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: E402

NO_COLLECTIVES = object()  # loading and slicing never all-reduce (tests/model/test_weights.py)
K_SHAPES = dict(hidden_size=256, intermediate_size=256)  # K-quant blocks are 256 wide

# (HF model_type, tensor type of the matrices); the embedding takes Q8_0 in one case, as in SmolLM2.
CASES = [("llama", t) for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")] + \
        [("qwen2", t) for t in ("F32", "Q8_0", "Q4_1", "Q2_K")] + [("qwen3", t) for t in ("F16", "Q4_0", "Q5_K", "Q3_K")]


def write(tmp_path, model_type, qtype, seed=0, **kw):
    hf = tiny_hf(model_type, seed=seed, **((K_SHAPES if qtype.endswith("_K") else {}) | kw))
    return hf, write_gguf(hf, tmp_path / f"tiny-{model_type}-{qtype}.gguf", qtype, seed=seed)


def transformers_tensors(hf, path):
    """transformers' own dequantized (and, for Llama q/k, un-permuted) copy of the file's tensors."""
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]


@pytest.mark.parametrize("model_type,qtype", CASES)
def test_loaded_weights_equal_transformers_dequantized(tmp_path, model_type, qtype):
    hf, path = write(tmp_path, model_type, qtype)
    want = transformers_tensors(hf, path)
    cfg = EngineConfig(checkpoint=str(path)).model
    assert cfg.architecture == type(hf).__name__ and cfg.dtype == "float32"
    # The file holds llama.cpp's q/k row order, not HF's: loading it as stored would be wrong.
    if model_type == "llama":
        raw = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.attn_q.weight")
        stored = gguf.quants.dequantize(raw.data, raw.tensor_type)
        assert not np.array_equal(stored, want["model.layers.0.self_attn.q_proj.weight"].numpy())
    for tp in (1, 2, 4):  # TP=4 replicates the 2 KV heads
        for rank in range(tp):
            m = build_model(cfg, tp_rank=rank, tp_size=tp, tp_group=NO_COLLECTIVES if tp > 1 else None,
                            kernel="torch")
            m.load_weights(str(path))
            shards = m.weight_shards()
            assert set(shards) | ({"lm_head.weight"} if cfg.tie_word_embeddings else set()) == set(want)
            for name, shard in shards.items():
                for piece in shard.pieces():
                    assert torch.equal(piece.dest, want[name][piece.index()]), f"tp={tp} rank={rank} {name}"
    assert torch.isfinite(want["model.layers.0.mlp.down_proj.weight"]).all()


def test_a_bfloat16_engine_casts_the_dequantized_weights(tmp_path):
    hf, path = write(tmp_path, "llama", "Q4_1")
    cfg = EngineConfig(checkpoint=str(path), model={"dtype": "bfloat16"}).model
    m = build_model(cfg, kernel="torch")
    m.load_weights(str(path))
    want = transformers_tensors(hf, path)["model.layers.1.mlp.up_proj.weight"]
    got = m.weight_shards()["model.layers.1.mlp.up_proj.weight"]
    assert got.dest.dtype == torch.bfloat16 and torch.equal(got.dest, want[got.index()].to(torch.bfloat16))


# -- greedy tokens against transformers on the same file ------------------------------------------
def prompts(vocab, n=3):
    rng = np.random.default_rng(5)
    return [rng.integers(0, vocab, int(rng.integers(5, 40))).tolist() for _ in range(n)]


@pytest.mark.parametrize("model_type,qtype", [("llama", "Q4_1"), ("qwen2", "Q8_0"), ("qwen3", "Q4_0")])
def test_engine_greedy_tokens_equal_hf_on_the_same_gguf(tmp_path, model_type, qtype):
    from ray_attn.engine import LLMEngine, SamplingParams
    from ray_attn.runtime import InProcessExecutor

    hf, path = write(tmp_path, model_type, qtype, seed=3)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    cfg = EngineConfig(checkpoint=str(path), cache=CacheConfig(num_blocks=64),
                       parallel=ParallelConfig(device="cpu", kernel="torch"), max_num_batched_tokens=64)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    try:
        ps = prompts(cfg.model.vocab_size)
        got = [o.output_token_ids for o in eng.generate(ps, SamplingParams(max_tokens=12, ignore_eos=True))]
    finally:
        eng.shutdown()
    want = []
    ref.generation_config.eos_token_id = None  # LlamaConfig's default eos (2) would stop HF early
    with torch.no_grad():
        for p in ps:
            ids = torch.tensor([p])  # the mask given: else HF takes every token equal to pad_token_id for padding
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                               pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    assert got == want
    assert len({tuple(t) for t in got}) == len(got)  # the tokens follow the prompt: the check means something


# -- what the config takes and what it refuses ------------------------------------------------------
def test_hf_causal_lm_is_transformers_own_reading_with_the_header_read_once(tmp_path, monkeypatch):
    """``gguf_file.hf_causal_lm`` (the reference of the demo, lm-eval tests and scripts): the same
    config and weights as transformers' plain load, the file's header parsed once instead of
    twice (by ``gguf_reader``'s reader), and gguf's names back as they were afterwards."""
    import gguf

    from ray_attn import gguf_reader
    from ray_attn.gguf_file import hf_causal_lm

    _, path = write(tmp_path, "llama", "Q4_1", seed=3)
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                              dtype=torch.float32)
    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    opened = []
    fast = gguf_reader.FastGGUFReader
    monkeypatch.setattr(gguf_reader, "FastGGUFReader", lambda *a, **k: opened.append(a) or fast(*a, **k))
    ours = hf_causal_lm(str(path))
    assert len(opened) == 1 and not ours.training  # through our reader, once
    assert gguf.get_tensor_name_map is name_map and gguf.GGUFReader is reader_cls
    assert ours.config.to_dict() == plain.config.to_dict()
    want = plain.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in ours.state_dict().items()) and ours.state_dict().keys() == want.keys()


def test_a_folder_of_one_gguf_is_the_checkpoint_and_two_are_refused(tmp_path):
    _, path = write(tmp_path, "qwen2", "Q8_0")
    by_file = EngineConfig(checkpoint=str(path)).model
    assert EngineConfig(checkpoint=str(tmp_path)).model == by_file
    assert (by_file.hidden_size, by_file.num_attention_heads, by_file.num_key_value_heads) == (128, 4, 2)
    (tmp_path / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(other.gguf, tiny-qwen2-Q8_0.gguf\)"):
        EngineConfig(checkpoint=str(tmp_path))


def test_a_model_mapping_overrides_and_a_disagreeing_model_is_refused(tmp_path):
    _, path = write(tmp_path, "llama", "F16")
    assert EngineConfig(checkpoint=str(path), model={"dtype": "bfloat16"}).model.dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"hidden_size=256 \(GGUF metadata: 128\)"):
        EngineConfig(checkpoint=str(path), model={"hidden_size": 256})


def test_missing_and_corrupt_files_are_errors_naming_the_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ValueError, match=f"GGUF checkpoint '{missing}' does not exist"):
        EngineConfig(checkpoint=str(missing))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match=f"{junk}: not a readable GGUF file"):
        EngineConfig(checkpoint=str(junk))
    _, path = write(tmp_path, "llama", "Q8_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:400])  # the header and part of the metadata
    with pytest.raises(ValueError, match=f"{cut}: not a readable GGUF file"):
        EngineConfig(checkpoint=str(cut))


def test_unsupported_architecture_and_tensor_types_are_refused_by_name(tmp_path):
    hf = tiny_hf("llama")
    other = write_gguf(hf, tmp_path / "gptneox.gguf", "F16", architecture="gptneox")
    with pytest.raises(ValueError, match="GGUF architecture 'gptneox' is not supported; supported: llama, qwen2, qwen3"):
        EngineConfig(checkpoint=str(other))
    f64 = write_gguf(hf, tmp_path / "f64.gguf", "F16",
                     extra_tensors={"blk.0.extra.weight": (np.zeros((4, 8), np.float64), None)})
    with pytest.raises(ValueError, match=r"1 tensor\(s\) of a type gguf cannot dequantize: blk.0.extra.weight \(F64\)"):
        EngineConfig(checkpoint=str(f64))
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    bad = write_gguf(hf, tmp_path / "q81.gguf", "F16", extra_tensors={
        "blk.1.extra.weight": (np.zeros((4, gguf.GGML_QUANT_SIZES[q8_1][1]), np.uint8), q8_1)})
    with pytest.raises(ValueError, match=r"blk.1.extra.weight \(Q8_1\)"):
        EngineConfig(checkpoint=str(bad))
    rope = write_gguf(hf, tmp_path / "rope.gguf", "F16", extra_tensors={"rope_freqs.weight": (np.ones(16, np.float32), None)})
    with pytest.raises(ValueError, match="tensor 'rope_freqs.weight' .* is not supported"):
        EngineConfig(checkpoint=str(rope))


def test_a_tensor_the_family_does_not_use_is_refused_at_load(tmp_path):
    hf = tiny_hf("llama")
    path = write_gguf(hf, tmp_path / "extra.gguf", "F32", extra_tensors={"blk.0.attn_q.bias": (np.zeros(128, np.float32), None)})
    m = build_model(EngineConfig(checkpoint=str(path)).model, kernel="torch")
    with pytest.raises(ValueError, match=r"has 1 tensor\(s\) this LlamaForCausalLM does not use: "
                                         r"model.layers.0.self_attn.q_proj.bias"):
        m.load_weights(str(path))


def test_the_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    from ray_attn.gguf_file import load_tokenizer
    from tests.tokenizer_fixture import CHATML, EOS_ID, build_tokenizer

    build_tokenizer(tmp_path / "tok", 512)
    want = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    path = write_gguf(tiny_hf("llama", vocab_size=512), tmp_path / "with-tok.gguf", "Q8_0", tokenizer=want, chat_template=CHATML)
    tok = load_tokenizer(str(path))
    text = "hello world, café naïve — 日本語 🚀"
    assert tok.encode(text, add_special_tokens=False) == want.encode(text, add_special_tokens=False)
    assert tok.eos_token_id == EOS_ID == EngineConfig(checkpoint=str(path)).model.eos_token_ids[0]
    msgs = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        want.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_the_tokenizer_is_built_once_then_read_from_the_cache(tmp_path, monkeypatch):
    """The first load builds the tokenizer from the metadata and saves it; the next ones read the
    saved folder -- the same tokenizer, chat template and special tokens -- until the file
    changes.  A damaged entry is rebuilt; RAY_ATTN_CACHE_DIR=0 turns the cache off."""
    import os
    import time

    from ray_attn import gguf_file
    from tests.tokenizer_fixture import CHATML, build_tokenizer

    build_tokenizer(tmp_path / "tok", 512)
    want = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    path = write_gguf(tiny_hf("llama", vocab_size=512), tmp_path / "m.gguf", "Q8_0", tokenizer=want, chat_template=CHATML)
    monkeypatch.setenv("RAY_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    real = transformers.AutoTokenizer.from_pretrained
    built = []

    def counting(folder, *a, **kw):
        if kw.get("gguf_file"):
            built.append(kw["gguf_file"])
        return real(folder, *a, **kw)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counting)
    text, msgs = "hello world, café naïve — 日本語 🚀", [{"role": "user", "content": "hello"}]

    def same(tok):
        assert tok.encode(text, add_special_tokens=False) == want.encode(text, add_special_tokens=False)
        assert (tok.eos_token_id, tok.bos_token_id, tok.all_special_ids) == \
            (want.eos_token_id, want.bos_token_id, want.all_special_ids)
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
            want.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    for _ in range(2):
        same(gguf_file.load_tokenizer(str(path)))
    assert built == ["m.gguf"]  # built once, then read back
    (entry,) = (tmp_path / "cache" / "tokenizers").iterdir()
    (entry / "tokenizer.json").write_text("{not json")  # damaged: rebuilt, and saved anew
    same(gguf_file.load_tokenizer(str(path)))
    same(gguf_file.load_tokenizer(str(path)))
    assert built == ["m.gguf"] * 2
    time.sleep(0.01)
    os.utime(path)  # the file changed: built again, under a new key
    same(gguf_file.load_tokenizer(str(path)))
    assert built == ["m.gguf"] * 3 and len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2
    monkeypatch.setenv("RAY_ATTN_CACHE_DIR", "0")
    same(gguf_file.load_tokenizer(str(path)))
    assert built == ["m.gguf"] * 4


@pytest.mark.parametrize("model_type,qtype,with_tokenizer", [("llama", "Q8_0", True), ("qwen2", "F16", False),
                                                              ("qwen3", "Q4_0", False)])
def test_the_config_is_the_one_transformers_reads(tmp_path, model_type, qtype, with_tokenizer):
    """``gguf_file.transformers_config`` reads the metadata from our one reader with transformers'
    own tables: it must equal what ``load_gguf_checkpoint`` builds, key for key."""
    from ray_attn.gguf_file import reader, transformers_config
    from tests.tokenizer_fixture import CHATML, build_tokenizer

    tok = None
    if with_tokenizer:
        build_tokenizer(tmp_path / "tok", 512)
        tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    hf = tiny_hf(model_type, vocab_size=512)
    path = write_gguf(hf, tmp_path / "m.gguf", qtype, tokenizer=tok, chat_template=CHATML if tok else None)
    want = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    assert transformers_config(reader(str(path))) == want
    assert ("eos_token_id" in want) == with_tokenizer
