"""Engines on a tiny test checkpoint, as many tests build them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chassis.core.async_llm import AsyncLLM
from chassis.core.config import EngineConfig

#: float32 (exact comparisons), a short context and a small KV cache: a fast start
TINY_ENGINE = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64}


def tiny_async_llm(model_dir: Path | str, **settings: Any) -> AsyncLLM:
    """An ``AsyncLLM`` (engine core in a child process) on ``model_dir`` with
    :data:`TINY_ENGINE`'s settings, ``settings`` overriding them; the caller shuts it down."""
    return AsyncLLM.from_engine_config(
        EngineConfig(model=str(model_dir), **{**TINY_ENGINE, **settings})
    )
