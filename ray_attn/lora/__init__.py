"""Multi-LoRA serving: PEFT adapters on one base model, mixed in one batch (see config.py,
peft_format.py, punica.py, layers.py, manager.py).  Importing the package does not import torch:
Serve's proxy callback, the HTTP front and the deploying drivers read the config only."""

from ray_attn.lora.config import TARGET_MODULES, LoRAAdapterError, LoRAConfig, LoRARequest  # noqa: F401
