"""A checkpoint's own description of its model, read without building it: the ``ModelConfig``
fields of an HF-format folder (config.json, generation_config.json), per family through
``ray_attn.hf_config``, or of a GGUF file (its metadata, through ``ray_attn.gguf_file``).
"""

from __future__ import annotations

import json
import os

from ray_attn import gguf_file, hf_config


def _read_json(path: str) -> dict:
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def pretrained_fields(folder: str) -> dict:
    """``ModelConfig`` fields of an HF-format checkpoint folder: its config.json's, with the end-of-
    sequence ids of its generation_config.json where that file sets ``eos_token_id`` (what
    transformers' ``generate`` stops on), else config.json's.  A GGUF (a ``.gguf`` file, or a
    folder without config.json holding one) gives its metadata's."""
    path = gguf_file.gguf_path(folder)
    if path is not None:
        return gguf_file.gguf_fields(path)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder {folder!r} does not exist (or is not a directory)")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint folder {folder!r} has no config.json; an HF-format checkpoint "
                                "holds config.json next to its *.safetensors (or one .gguf file)")
    fields = hf_config.fields_from_hf(_read_json(path), folder)
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(gen_path):
        gen = _read_json(gen_path)
        if "eos_token_id" in gen:
            fields["eos_token_ids"] = hf_config.eos_token_ids(gen["eos_token_id"], gen_path)
    return fields
