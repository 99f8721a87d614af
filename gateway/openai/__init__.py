"""OpenAI request schemas and response/stream encoding shared by the public endpoints."""
