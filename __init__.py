"""chassis: a plugin-first LLM inference and serving engine.

Public API (vLLM-compatible names)::

    from chassis import LLM, LoRARequest, SamplingParams
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "PLUGIN_API_VERSION",
    "AsyncLLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineConfig",
    "LoRARequest",
    "Platform",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "__version__",
    "hookimpl",
]

if TYPE_CHECKING:
    from chassis.core.async_llm import AsyncLLM
    from chassis.core.beam_search import BeamSearchParams
    from chassis.core.config import EngineConfig
    from chassis.core.llm import LLM
    from chassis.core.lora import LoRARequest
    from chassis.core.outputs import CompletionOutput, RequestOutput
    from chassis.core.pooling_params import PoolingParams
    from chassis.core.sampling_params import SamplingParams
    from chassis.platforms.interface import Platform
    from chassis.plugins import PLUGIN_API_VERSION
    from chassis.plugins.hookspecs import hookimpl

# Imported on first use: `import chassis` stays cheap (no torch import until needed).
_LAZY = {
    "LLM": "chassis.core.llm",
    "AsyncLLM": "chassis.core.async_llm",
    "BeamSearchParams": "chassis.core.beam_search",
    "PoolingParams": "chassis.core.pooling_params",
    "EngineConfig": "chassis.core.config",
    "LoRARequest": "chassis.core.lora",
    "RequestOutput": "chassis.core.outputs",
    "CompletionOutput": "chassis.core.outputs",
    "SamplingParams": "chassis.core.sampling_params",
    "Platform": "chassis.platforms.interface",
    "PLUGIN_API_VERSION": "chassis.plugins",
    "hookimpl": "chassis.plugins.hookspecs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'chassis' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
