"""Batches (``/v1/batches``): OpenAI's Batch API; the work itself runs in ``gateway.batch_runner``."""
