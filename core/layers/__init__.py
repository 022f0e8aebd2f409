"""Reusable model layers (norms, rotary embedding, linear, attention wrapper) for model plugins."""
