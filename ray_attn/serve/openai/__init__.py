"""The OpenAI-compatible surface of the Serve app: ``/v1/completions``, ``/v1/chat/completions``
and ``/v1/models`` (one module each, over ``serving``'s choice sets and ``protocol``'s bodies)."""
