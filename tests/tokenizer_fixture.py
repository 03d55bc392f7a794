"""A real byte-level BPE tokenizer with a ChatML chat template, trained here with ``tokenizers``
(nothing downloaded), for the Serve, OpenAI and detokenizer tests."""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (the trainer puts them first)
EOS_ID = 2
# Tools go in a system turn of their own, as Hermes/Qwen templates put them.
CHATML = ("{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
          "<|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello ray, hello attention",
    "Paged attention keeps the key value cache in fixed size blocks.",
    "A planner on the driver builds the metadata; workers run the kernel.",
    "café naïve résumé — déjà vu",  # multi-byte characters: pieces that split a character
    "日本語のテキストと絵文字 🚀✨",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "Once upon a time there was a small model that answered questions.",
] * 20


def build_tokenizer(folder: Path | str, vocab_size: int) -> None:
    """Train and save (HF format, with the chat template) a BPE tokenizer of at most
    ``vocab_size`` tokens, so every id it makes is one the model can embed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 16, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.token_to_id("<|im_end|>") == EOS_ID
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    hf.save_pretrained(str(folder))
