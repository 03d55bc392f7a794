"""Speculative decoding on the driver: proposers (``ngram``) and the engine's bookkeeping around
the steps that verify their drafts (``decoder``)."""
