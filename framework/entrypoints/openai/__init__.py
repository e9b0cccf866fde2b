"""The OpenAI-compatible server's module entry point, named as vLLM's."""
