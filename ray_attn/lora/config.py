"""Multi-LoRA configuration and the per-request adapter name, under vLLM's names.

``LoRAConfig`` sits on ``EngineConfig.lora_config`` (vLLM's ``VllmConfig.lora_config``): how many
adapters the device holds at once (``max_loras``: the slots of the stacked weights every targeted
layer carries), the largest rank they may have (``max_lora_rank``: the stacks' padded width), and
how many each rank keeps in host memory (``max_cpu_loras``, an LRU in front of the disk).
``LoRARequest`` names the adapter of one request (vLLM's ``LoRARequest(lora_name, lora_int_id,
lora_path)``), passed to ``LLMEngine.add_request(..., lora_request=)`` as vLLM takes it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

from pydantic import Field, model_validator

from ray_attn.model_config import _Strict

# The projections an adapter may target, by the checkpoint names of HF Llama (and Mistral, Qwen,
# Gemma): attention's q/k/v/o and the gated MLP's gate/up/down.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and what is wrong.
    (Here, not in peft_format, which imports torch: the HTTP side catches it without torch.)"""


class LoRAConfig(_Strict):
    max_loras: int = Field(1, gt=0, description=(
        "Adapters resident on the device at once: every targeted layer holds this many slots of "
        "stacked A/B weights, and one step may mix requests of all of them and of the base model."))
    max_lora_rank: int = Field(16, gt=0, le=256, description=(
        "Largest adapter rank served; the slots are this wide (padded to a multiple of 16 for the "
        "kernels), and an adapter of a larger rank is refused by name."))
    max_cpu_loras: Optional[int] = Field(None, gt=0, description=(
        "Adapters each rank keeps in host memory (least recently used dropped first), so that a "
        "slot is refilled by a copy instead of a read from disk. None: max_loras."))

    @model_validator(mode="after")
    def _check(self):
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be at least max_loras={self.max_loras}")
        return self

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras

    @property
    def padded_rank(self) -> int:
        """The slots' width: ``max_lora_rank`` up to a multiple of 16 (tl.dot's smallest K)."""
        return -(-self.max_lora_rank // 16) * 16


@dataclass(frozen=True)
class LoRARequest:
    """One adapter by name, id and folder (vLLM's fields).  ``lora_int_id`` must be positive
    (0 would be the base model); two requests name the same adapter when their ids are equal."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be a positive int, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_request.lora_path must be a string, got {self.lora_path!r}")

    @property
    def cache_root(self) -> int:
        """The root of this adapter's prefix-cache hash chains (``planner/block_pool.py``): the
        same prompt under two adapters (or the base model) never shares a KV block.  Name, id
        and path all enter it, so an adapter loaded again under its name from another folder
        gets fresh keys."""
        key = f"{self.lora_name}\0{self.lora_int_id}\0{self.lora_path}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
