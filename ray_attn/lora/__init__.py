"""Multi-LoRA serving: PEFT adapters on one base model, mixed in one batch (see config.py,
peft_format.py, punica.py, layers.py, manager.py)."""

from ray_attn.lora.config import TARGET_MODULES, LoRAConfig, LoRARequest  # noqa: F401
from ray_attn.lora.peft_format import LoRAAdapterError  # noqa: F401
