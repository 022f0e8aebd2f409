"""The front-end's work while the engine core child starts (EngineCoreClient's
``while_starting``, AsyncLLM's tokenizer load): its failure stops the child."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from chassis.core.async_llm import AsyncLLM
from chassis.core.config import EngineConfig
from chassis.core.engine_client import EngineCoreClient
from chassis.core.engine_setup import finalize_config


def _config(model_dir: Path, **overrides: object) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), dtype="float32", max_model_len=128, num_kv_blocks=16, **overrides
    )


def _engine_children() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name == "chassis-engine-core"]


@pytest.mark.timeout(300)
def test_a_failure_while_starting_kills_the_child_and_propagates(tiny_llama_dir: Path) -> None:
    config = _config(tiny_llama_dir)
    finalize_config(config)
    started: list[bool] = []

    def fail() -> None:
        started.append(True)
        raise RuntimeError("front-end set-up failed")

    with pytest.raises(RuntimeError, match="front-end set-up failed"):
        EngineCoreClient(config, lambda outputs: None, lambda reason: None, while_starting=fail)
    assert started == [True]
    assert _engine_children() == []


@pytest.mark.timeout(300)
def test_an_unloadable_tokenizer_is_the_error_and_leaves_no_engine(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="could not load a tokenizer"):
        AsyncLLM.from_engine_config(_config(tiny_llama_dir, tokenizer=str(tmp_path)))
    assert _engine_children() == []


@pytest.mark.timeout(300)
def test_the_tokenizer_is_ready_with_the_engine(tiny_llama_dir: Path) -> None:
    llm = AsyncLLM.from_engine_config(_config(tiny_llama_dir))
    try:
        assert llm.tokenizer is not None
        ids = llm.tokenizer.encode("Hello there")
        assert llm.input_processor.tokenizer is llm.tokenizer
        assert llm.output_processor is not None and ids
    finally:
        llm.shutdown_sync()
