"""The serving benchmark's parts, shared by ``bench_serve.py`` and ``bench_throughput.py``.

``datasets`` draws the workload (token-id prompts, no tokenizer), ``driver`` sends it on vLLM's
arrival schedule through a transport, ``metrics`` turns what came back into vLLM's numbers.  Two
transports drive the same workload: ``openai_client`` (HTTP, OpenAI completions streaming) and
``engine_transport`` (an ``LLMEngine`` in this process behind ``ray_attn.serve.loop.EngineLoop``), so that
the GPU machine, which cannot run our HTTP app, measures the same metrics.
"""
