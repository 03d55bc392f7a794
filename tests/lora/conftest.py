from tests.lora.peft_fixture import lora_models  # noqa: F401  (the package's fixture)
