"""Errors the engine raises to its callers."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process died or hit a fatal error; no request can complete.

    The API server maps it to HTTP 503.
    """


class EngineOverloadedError(RuntimeError):
    """The engine refuses new work for now (queue full or shutting down); HTTP 503."""
