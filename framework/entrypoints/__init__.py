"""vLLM-compatible entry points (``python -m speculant.entrypoints.openai.api_server``)."""
