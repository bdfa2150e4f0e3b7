"""The OpenAI-compatible gateway (see app.py)."""
