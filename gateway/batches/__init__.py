"""Batches, one domain: OpenAI's Batch API (``endpoints``, ``schemas``, ``service``) and the batch tier
that runs it (``tasks``: Celery; ``runner``: validate, run and finalize a batch; ``lines``: one input
line through the generation service; ``runtime``: that service configured for batch work; ``dispatch``:
the run chains; ``repository``: every query)."""
