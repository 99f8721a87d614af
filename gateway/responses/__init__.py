"""The Responses API (``/v1/responses``): OpenAI's newest generation endpoint, served by the same
generation service as chat (``gateway.generation``)."""
