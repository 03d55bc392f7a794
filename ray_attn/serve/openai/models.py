"""``GET /v1/models``: the model a replica serves, under the name requests must use, and its
LoRA adapters (vLLM lists each with ``parent`` the base model)."""

from ray_attn.serve.openai.responses import ModelCard, ModelList


def list_models(server) -> dict:
    card = ModelCard(id=server.model_id, created=server.created, root=server.cfg.engine.checkpoint,
                     max_model_len=server.max_model_len, vocab_size=server.vocab_size)
    adapters = getattr(server, "adapters", None)
    cards = [card] + [card.model_copy(update={"id": name, "root": path, "parent": server.model_id})
                      for name, path in (adapters.cards() if adapters is not None else [])]
    return ModelList(data=cards).model_dump()
