"""Serving: the chassis CLI, the OpenAI-compatible FastAPI app, protocol models, SSE."""
