"""Embeddings (``/v1/embeddings``): vectors from the engine's pooling pass, admitted and metered like any
generation (by input tokens only)."""
