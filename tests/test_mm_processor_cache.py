"""The front-end's processed-item cache (``--mm-processor-cache-gb``,
core/multimodal_item_cache.py): keys (same image hits, another image or other kwargs miss),
LRU eviction by tensor bytes, 0 disables it, thread safety; a tiny Qwen2-VL engine's
front-end skips its processor for an image sent again with identical features; and the
server's ``/metrics`` counts queries and hits.
"""

from __future__ import annotations

import base64
import io
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_qwen2_vl import random_image, save_tiny_qwen2_vl

from chassis.core.config import EngineConfig
from chassis.core.engine_setup import finalize_config
from chassis.core.input_processor import InputProcessor
from chassis.core.multimodal_item_cache import ProcessedItemCache, item_key
from chassis.core.tokenizer import engine_tokenizer, eos_token_ids

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\n{IMAGE}Describe.<|im_end|>\n<|im_start|>assistant\n"


class Counting:
    """A stand-in processor: ``rows`` float32 rows of 4 values an item, counting calls."""

    def __init__(self, rows: int = 2) -> None:
        self.calls = 0
        self.rows = rows

    def __call__(self, modality: str, item: Any, kwargs: Any) -> tuple[int, dict[str, Any]]:
        self.calls += 1
        return self.rows, {"x": torch.full((self.rows, 4), float(self.calls))}


def test_same_image_hits_other_image_or_kwargs_miss() -> None:
    cache, process = ProcessedItemCache(1 << 20), Counting()
    first = cache.get_or_process("image", random_image(8, 8, seed=0), {}, process)
    again = cache.get_or_process("image", random_image(8, 8, seed=0), {}, process)
    assert process.calls == 1 and again is first
    cache.get_or_process("image", random_image(8, 8, seed=1), {}, process)
    cache.get_or_process("image", random_image(8, 8, seed=0), {"max_pixels": 64}, process)
    cache.get_or_process("video", random_image(8, 8, seed=0), {}, process)
    assert process.calls == 4
    stats = cache.stats()
    assert (stats.queries, stats.hits) == (5, 1)


def test_the_key_covers_mode_size_palette_metadata_and_kwargs_order() -> None:
    from PIL import Image

    image = random_image(8, 8)
    assert item_key("image", image, {"a": 1, "b": 2}) == item_key("image", image, {"b": 2, "a": 1})
    assert item_key("image", image, {}) != item_key("image", image.convert("RGBA"), {})
    assert item_key("image", image, {}) != item_key("image", image.resize((8, 4)), {})
    # same palette indices, different palettes: different images
    indices = Image.fromarray(np.zeros((4, 4), dtype=np.uint8), mode="P")
    other = indices.copy()
    other.putpalette([255, 0, 0] * 256)
    assert item_key("image", indices, {}) != item_key("image", other, {})
    frames = np.zeros((2, 4, 4, 3), dtype=np.uint8)
    one = item_key("video", (frames, {"fps": 2.0, "frames_indices": [0, 5]}), {})
    assert one != item_key("video", (frames, {"fps": 4.0, "frames_indices": [0, 5]}), {})
    assert one == item_key("video", (frames.copy(), {"frames_indices": [0, 5], "fps": 2.0}), {})
    assert item_key("image", object(), {}) is None  # (an unknown type: not cached)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
def test_tensors_of_dtypes_numpy_lacks_are_keyed_and_sized(dtype: torch.dtype) -> None:
    """A video or audio tensor in a dtype numpy has no counterpart for is keyed by its bytes
    (equal content hits, other content misses) and its result is sized by element size."""
    frames = torch.linspace(-2, 2, 2 * 3 * 4 * 4).view(2, 3, 4, 4).to(dtype)
    key = item_key("video", frames, {})
    assert key is not None and key == item_key("video", frames.clone(), {})
    assert key != item_key("video", (frames.float() * 2).to(dtype), {})
    # the same bytes in another dtype are another item
    assert key != item_key(
        "video", frames.view(torch.uint8 if frames.element_size() == 1 else torch.int16), {}
    )
    cache = ProcessedItemCache(1 << 10)
    calls: list[str] = []

    def process(modality: str, item: Any, kwargs: Any) -> tuple[int, dict[str, Any]]:
        calls.append(modality)
        tensor = item[0] if isinstance(item, tuple) else item  # (a (waveform, rate) pair)
        return 2, {"x": tensor.reshape(2, -1)}  # (in the item's dtype)

    waveform = torch.linspace(-1, 1, 64).to(dtype)
    for _ in range(2):
        cache.get_or_process("audio", (waveform, 16000), {}, process)
        cache.get_or_process("audio", waveform[None], {}, process)
    assert calls == ["audio", "audio"]
    assert cache.size_bytes == 2 * 64 * waveform.element_size()


def test_lru_eviction_by_tensor_bytes() -> None:
    # each result holds 2 x 4 float32 = 32 bytes: three fit in 100, the fourth evicts
    cache, process = ProcessedItemCache(100), Counting()
    images = [random_image(4, 4, seed=s) for s in range(4)]
    for image in images[:3]:
        cache.get_or_process("image", image, {}, process)
    assert (len(cache), cache.size_bytes) == (3, 96)
    cache.get_or_process("image", images[0], {}, process)  # (0 is now the most recent)
    cache.get_or_process("image", images[3], {}, process)  # evicts 1, the least recent
    assert (len(cache), cache.size_bytes, process.calls) == (3, 96, 4)
    cache.get_or_process("image", images[0], {}, process)
    cache.get_or_process("image", images[2], {}, process)
    assert process.calls == 4
    cache.get_or_process("image", images[1], {}, process)
    assert process.calls == 5
    # a result larger than the whole cache is not kept
    big = ProcessedItemCache(16)
    big.get_or_process("image", images[0], {}, process)
    big.get_or_process("image", images[0], {}, process)
    assert (len(big), process.calls) == (0, 7)


def test_zero_disables_and_errors_are_not_cached() -> None:
    assert ProcessedItemCache.from_gb(0) is None
    assert ProcessedItemCache.from_gb(4).capacity_bytes == 4 * 2**30
    with pytest.raises(ValueError, match="--mm-processor-cache-gb must be a number"):
        EngineConfig(mm_processor_cache_gb=-1)
    cache = ProcessedItemCache(1 << 10)

    def failing(modality: str, item: Any, kwargs: Any) -> Any:
        raise ValueError("the image cannot be processed")

    for _ in range(2):
        with pytest.raises(ValueError, match="cannot be processed"):
            cache.get_or_process("image", random_image(4, 4), {}, failing)
    assert len(cache) == 0


def test_threads_share_the_cache() -> None:
    cache, process = ProcessedItemCache(1 << 20), Counting()
    images = [random_image(8, 8, seed=s) for s in range(4)]
    results: list[Any] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        for _ in range(25):
            for image in images:
                results.append(cache.get_or_process("image", image, {}, process))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = cache.stats()
    assert stats.queries == len(results) == 800
    assert stats.hits == 800 - process.calls
    assert process.calls < 800 and len(cache) == 4


# -- a tiny Qwen2-VL front-end ----------------------------------------------------------------


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"))


def _input_processor(model_dir: Path, **settings: Any) -> InputProcessor:
    config = EngineConfig(model=str(model_dir), max_model_len=256, **settings)
    finalize_config(config)
    tokenizer = engine_tokenizer(config)
    return InputProcessor(tokenizer, config, eos_token_ids(tokenizer, config.model))


def _expand(processor: InputProcessor, image: Any, kwargs: Any = None) -> tuple[list[int], Any]:
    ids = processor.tokenize(PROMPT)
    return processor.multimodal.expand(ids, {"image": image}, kwargs)


def _spy(processor: InputProcessor) -> list[int]:
    """Counts the model processor's ``process_item`` calls."""
    mm = processor.multimodal.processor()
    calls: list[int] = []
    original = mm.process_item

    def counted(*args: Any) -> Any:
        calls.append(1)
        return original(*args)

    mm.process_item = counted  # type: ignore[method-assign]
    return calls


def test_front_end_skips_the_processor_for_an_image_sent_again(vl_dir: Path) -> None:
    processor = _input_processor(vl_dir)
    calls = _spy(processor)
    image = random_image(84, 112, seed=3)
    ids, [feature] = _expand(processor, image)
    again_ids, [again] = _expand(processor, random_image(84, 112, seed=3))
    assert len(calls) == 1
    assert again_ids == ids and again == feature  # (same identifier, offsets, tensors)
    _expand(processor, random_image(84, 112, seed=4))
    _, [small] = _expand(processor, image, {"max_pixels": 56 * 56})
    assert len(calls) == 3 and small.length < feature.length
    stats = processor.multimodal.item_cache.stats()
    assert (stats.queries, stats.hits) == (4, 1)
    # (the default: 4 GiB, vLLM's)
    assert processor.multimodal.item_cache.capacity_bytes == 4 * 2**30


def test_cache_gb_zero_processes_every_time(vl_dir: Path) -> None:
    processor = _input_processor(vl_dir, mm_processor_cache_gb=0)
    assert processor.multimodal.item_cache is None
    calls = _spy(processor)
    image = random_image(56, 56, seed=3)
    _, [first] = _expand(processor, image)
    _, [second] = _expand(processor, image)
    assert len(calls) == 2 and first == second


# -- the server's /metrics ----------------------------------------------------------------------


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*engine=\"0\"[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


@pytest.mark.timeout(300)
def test_server_metrics_count_queries_and_hits(vl_dir: Path) -> None:
    from fastapi.testclient import TestClient

    from chassis.core.async_llm import AsyncLLM
    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    def url(seed: int) -> str:
        buffer = io.BytesIO()
        random_image(70, 98, seed=seed).save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    engine = AsyncLLM.from_engine_config(
        EngineConfig(model=str(vl_dir), dtype="float32", max_model_len=128, num_kv_blocks=64)
    )
    answers = []
    try:
        with TestClient(build_app(engine, ServerSettings(shutdown_engine_on_exit=False))) as client:
            for seed in (0, 0, 1):
                body = {
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": url(seed)}},
                                {"type": "text", "text": "Describe."},
                            ],
                        }
                    ],
                    "max_tokens": 4,
                    "temperature": 0,
                    "return_token_ids": True,
                }
                answer = client.post("/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
                answers.append(answer.json())
            text = client.get("/metrics").text
    finally:
        engine.shutdown_sync()
    assert answers[0]["choices"][0]["token_ids"] == answers[1]["choices"][0]["token_ids"]
    assert answers[0]["prompt_token_ids"] == answers[1]["prompt_token_ids"]
    assert _metric(text, "chassis:mm_cache_queries_total") == 3
    assert _metric(text, "chassis:mm_cache_hits_total") == 1
