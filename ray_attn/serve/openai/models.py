"""``GET /v1/models``: the one model a replica serves, under the name requests must use."""

from ray_attn.serve.openai.responses import ModelCard, ModelList


def list_models(server) -> dict:
    card = ModelCard(id=server.model_id, created=server.created, root=server.cfg.engine.checkpoint,
                     max_model_len=server.max_model_len, vocab_size=server.vocab_size)
    return ModelList(data=[card]).model_dump()
