"""vLLM's multimodal server flags: ``--mm-processor-kwargs`` (the processor's defaults, a
request's keys win), ``--media-io-kwargs`` (video ``num_frames`` / ``fps``, image
``rgba_background_color``) and ``--allowed-media-domains`` (other hosts refused before any
fetch), parsed from the command line, checked at start, and in effect in the front-end, the
offline ``LLM`` and the server's chat route, on a tiny random Qwen2.5-VL
(tests/fixtures_qwen2_vl.py).
"""

from __future__ import annotations

import argparse
import base64
import http.server
import io
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures_qwen2_vl import random_image, save_tiny_qwen2_vl

from chassis.core.config import EngineConfig
from chassis.core.engine_setup import finalize_config
from chassis.core.input_processor import InputProcessor
from chassis.core.media_options import media_loaders
from chassis.core.sampling_params import SamplingParams
from chassis.core.tokenizer import engine_tokenizer, eos_token_ids
from chassis.core.video_loading import sample_frame_indices
from chassis.serve.args import add_engine_args, engine_config_from_args

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
SMALL = {"max_pixels": 56 * 56}  # 4x4 patches: 4 tokens an image
LARGE = {"max_pixels": 112 * 112}  # the checkpoint's bound: 8x8 patches, 16 tokens


def _prompt(placeholder: str) -> str:
    return f"<|im_start|>user\n{placeholder}Describe.<|im_end|>\n<|im_start|>assistant\n"


def _png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def _mp4(count: int = 10, fps: int = 4) -> bytes:
    """``count`` random 56x56 frames at ``fps`` in MP4 (which records its frame count)."""
    import av

    frames = np.random.default_rng(0).integers(0, 256, (count, 56, 56, 3), dtype=np.uint8)
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as video:
        stream = video.add_stream("libx264rgb", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "rgb24"
        stream.options = {"crf": "0"}
        for frame in frames:
            video.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        video.mux(stream.encode())
    return out.getvalue()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_5_vl"), "qwen2_5_vl")


# -- the flags ---------------------------------------------------------------------------------


def test_flags_parse_into_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, with_plugins=False)
    args = parser.parse_args(
        [
            "--mm-processor-kwargs",
            '{"max_pixels": 3136}',
            "--media-io-kwargs",
            '{"video": {"num_frames": 8, "fps": 2}, "image": {"rgba_background_color": [0, 0, 0]}}',
            "--allowed-media-domains",
            "Example.com",
            "cdn.example.org",
            "--mm-processor-cache-gb",
            "0.5",
            "--mm-processor-cache-type",
            "lru",
        ]
    )
    config = engine_config_from_args(args)
    assert config.mm_processor_kwargs == {"max_pixels": 3136}
    assert config.media_io_kwargs == {
        "video": {"num_frames": 8, "fps": 2},
        "image": {"rgba_background_color": [0, 0, 0]},
    }
    assert config.allowed_media_domains == ["Example.com", "cdn.example.org"]
    assert config.mm_processor_cache_gb == 0.5
    defaults = engine_config_from_args(parser.parse_args([]))
    assert (defaults.mm_processor_kwargs, defaults.media_io_kwargs) == (None, None)
    assert (defaults.allowed_media_domains, defaults.mm_processor_cache_gb) == (None, 4.0)
    with pytest.raises(SystemExit):  # (vLLM's shared-memory cache is not supported)
        parser.parse_args(["--mm-processor-cache-type", "shm"])


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"media_io_kwargs": {"audio": {}}}, "audio not supported"),
        ({"media_io_kwargs": {"video": {"frames": 4}}}, "video: frames not supported"),
        ({"media_io_kwargs": {"video": {"num_frames": 0}}}, "num_frames must be an integer >= 1"),
        ({"media_io_kwargs": {"video": {"fps": -1}}}, "fps must be a number > 0"),
        ({"media_io_kwargs": {"image": {"image_mode": "L"}}}, "image: image_mode not supported"),
        (
            {"media_io_kwargs": {"image": {"rgba_background_color": [0, 0, 256]}}},
            "integers 0-255",
        ),
        ({"media_io_kwargs": [1]}, "must be a JSON object"),
        ({"allowed_media_domains": "example.com"}, "takes host names"),
        ({"allowed_media_domains": ["https://example.com"]}, "no scheme, port or path"),
        ({"mm_processor_kwargs": [1]}, "--mm-processor-kwargs must be a JSON object"),
        ({"mm_processor_cache_gb": float("inf")}, "--mm-processor-cache-gb"),
    ],
)
def test_bad_values_are_refused_when_the_config_is_made(
    settings: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**settings)


# -- --mm-processor-kwargs -------------------------------------------------------------------------


def _input_processor(model_dir: Path, **settings: Any) -> InputProcessor:
    config = EngineConfig(model=str(model_dir), max_model_len=256, **settings)
    finalize_config(config)
    tokenizer = engine_tokenizer(config)
    return InputProcessor(tokenizer, config, eos_token_ids(tokenizer, config.model))


def test_server_defaults_change_the_placeholders_and_a_request_key_wins(vl_dir: Path) -> None:
    image = random_image(112, 112, seed=2)

    def expand(processor: InputProcessor, kwargs: Any = None) -> Any:
        ids = processor.tokenize(_prompt(IMAGE))
        [feature] = processor.multimodal.expand(ids, {"image": image}, kwargs)[1]
        return feature

    plain = _input_processor(vl_dir, mm_processor_cache_gb=0)
    small = _input_processor(vl_dir, mm_processor_kwargs=SMALL)
    assert expand(plain).length == 16
    default = expand(small)
    assert default.length == 4
    assert default.data["pixel_values"].shape[0] == 16  # (4x4 patches of 14 pixels)
    assert default == expand(plain, SMALL)  # (the same as a request sending them)
    assert expand(small, LARGE).length == 16  # the request's max_pixels wins
    # key by key: the request's min_pixels leaves the server's max_pixels in force
    assert expand(small, {"min_pixels": 56 * 56}).length == 4


def test_bad_server_kwargs_fail_the_start_with_a_requests_message(vl_dir: Path) -> None:
    with pytest.raises(ValueError, match="--mm-processor-kwargs: mm_processor_kwargs: foo not"):
        _input_processor(vl_dir, mm_processor_kwargs={"foo": 1})
    with pytest.raises(ValueError, match=r"min_pixels .* must not exceed max_pixels"):
        _input_processor(vl_dir, mm_processor_kwargs={"min_pixels": 20000, "max_pixels": 3136})


@pytest.mark.timeout(300)
def test_llm_takes_both_kwargs(vl_dir: Path) -> None:
    """``LLM(..., mm_processor_kwargs=..., media_io_kwargs=...)``: an image's tokens follow
    the defaults unless the prompt's own kwargs say otherwise; a chat video keeps
    ``num_frames`` frames (4 of 10: grid_t 2, 2 * 16 / 4 = 8 tokens, 20 for all 10)."""
    from chassis.core.llm import LLM

    pytest.importorskip("av")
    llm = LLM(
        str(vl_dir),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=64,
        mm_processor_kwargs=SMALL,
        media_io_kwargs={"video": {"num_frames": 4}},
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    image = random_image(112, 112, seed=2)
    try:
        outputs = llm.generate(
            [
                {"prompt": _prompt(IMAGE), "multi_modal_data": {"image": image}},
                {
                    "prompt": _prompt(IMAGE),
                    "multi_modal_data": {"image": image},
                    "mm_processor_kwargs": LARGE,
                },
            ],
            params,
        )
        video_part = {"type": "video_url", "video_url": {"url": _data_url(_mp4(), "video/mp4")}}
        [chatted] = llm.chat(
            [{"role": "user", "content": [video_part, {"type": "text", "text": "Describe."}]}],
            params,
        )
        image_pad, video_pad = llm.input_processor.tokenize("<|image_pad|><|video_pad|>")
    finally:
        llm.shutdown()
    assert [list(o.prompt_token_ids).count(image_pad) for o in outputs] == [4, 16]
    assert list(chatted.prompt_token_ids).count(video_pad) == 8


# -- --media-io-kwargs -----------------------------------------------------------------------------


def test_video_num_frames_and_fps_choose_the_frames_kept() -> None:
    pytest.importorskip("av")
    url = _data_url(_mp4(), "video/mp4")  # 10 frames at 4 fps: 2.5 s

    def kept(video_kwargs: dict[str, Any]) -> tuple[int, list[int]]:
        _, loader, _ = media_loaders(EngineConfig(media_io_kwargs={"video": video_kwargs}))
        frames, metadata = loader.load(url)
        assert frames.shape[0] == len(metadata["frames_indices"])
        return frames.shape[0], metadata["frames_indices"]

    assert kept({}) == (10, list(range(10)))  # (32 by default: every frame of 10)
    assert kept({"num_frames": 4}) == (4, [0, 3, 6, 9])
    # fps 2 over 2.5 s: 5 frames; num_frames still the most
    assert kept({"fps": 2}) == (5, [0, 2, 4, 6, 9])
    assert kept({"fps": 2, "num_frames": 3}) == (3, [0, 4, 9])
    assert kept({"fps": 100, "num_frames": -1}) == (10, list(range(10)))
    assert sample_frame_indices(100, 32, fps=0.1, duration=5.0) == [0]  # (at least one)


def test_image_background_color() -> None:
    from PIL import Image

    clear = Image.new("RGBA", (4, 4), (10, 200, 30, 0))
    url = _data_url(_png(clear), "image/png")
    white, _, _ = media_loaders(EngineConfig())
    black, _, _ = media_loaders(
        EngineConfig(media_io_kwargs={"image": {"rgba_background_color": [0, 0, 0]}})
    )
    assert white.load(url).getpixel((0, 0)) == (255, 255, 255)
    assert black.load(url).getpixel((0, 0)) == (0, 0, 0)
    assert black.load(clear).getpixel((0, 0)) == (0, 0, 0)


# -- --allowed-media-domains -------------------------------------------------------------------


def test_other_hosts_are_refused_before_any_fetch(monkeypatch: pytest.MonkeyPatch) -> None:
    fetched: list[str] = []

    def urlopen(request: Any, timeout: float) -> Any:
        fetched.append(request.full_url)
        raise OSError("no network in tests")

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    image, video, audio = media_loaders(EngineConfig(allowed_media_domains=["CDN.example.com"]))
    for loader, url in (
        (image, "https://evil.example.org/cat.png"),
        (image, "http://cdn.example.com.evil.org/cat.png"),
        (video, "https://evil.example.org/clip.mp4"),
    ):
        with pytest.raises(ValueError, match=r"is not one of --allowed-media-domains \(cdn\."):
            loader.load(url)
    with pytest.raises(ValueError, match=r"audio URL .* is not one of --allowed-media-domains"):
        audio.load_url("https://evil.example.org/clip.wav")
    assert fetched == []
    # the allowed host (any case, any port) is fetched; data URLs need no host
    for url in ("https://cdn.example.com/cat.png", "http://Cdn.Example.com:8080/cat.png"):
        with pytest.raises(ValueError, match="no network in tests"):
            image.load(url)
    assert len(fetched) == 2
    assert image.load(_data_url(_png(random_image(4, 4)), "image/png")).size == (4, 4)
    # without the flag: any host
    anywhere, _, _ = media_loaders(EngineConfig())
    with pytest.raises(ValueError, match="no network in tests"):
        anywhere.load("https://evil.example.org/cat.png")


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""
    requests: list[str] = []

    def do_GET(self) -> None:
        self.requests.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def image_server() -> Iterator[int]:
    _Handler.body = _png(random_image(112, 112, seed=2))
    _Handler.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.timeout(300)
def test_server_chat_route(vl_dir: Path, image_server: int) -> None:
    """``--allowed-media-domains 127.0.0.1`` and ``--mm-processor-kwargs`` over a real
    engine: the allowed host's image is fetched and processed with the server's
    max_pixels (a request's own win); ``localhost``, the same server by another name, is a
    400 naming it, and nothing is fetched."""
    from fastapi.testclient import TestClient

    from chassis.core.async_llm import AsyncLLM
    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    engine = AsyncLLM.from_engine_config(
        EngineConfig(
            model=str(vl_dir),
            dtype="float32",
            max_model_len=128,
            num_kv_blocks=64,
            allowed_media_domains=["127.0.0.1"],
            mm_processor_kwargs=SMALL,
        )
    )

    def chat(host: str, **extra: Any) -> Any:
        url = f"http://{host}:{image_server}/cat.png"
        body = {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "Describe."},
                    ],
                }
            ],
            "max_tokens": 2,
            "temperature": 0,
            **extra,
        }
        return client.post("/v1/chat/completions", json=body)

    try:
        with TestClient(build_app(engine, ServerSettings(shutdown_engine_on_exit=False))) as client:
            small = chat("127.0.0.1")
            large = chat("127.0.0.1", mm_processor_kwargs=LARGE)
            refused = chat("localhost")
    finally:
        engine.shutdown_sync()
    assert small.status_code == large.status_code == 200, (small.text, large.text)
    tokens = [answer.json()["usage"]["prompt_tokens"] for answer in (small, large)]
    assert tokens[1] - tokens[0] == 16 - 4
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert "'localhost' is not one of --allowed-media-domains (127.0.0.1)" in message
    assert _Handler.requests == ["/cat.png", "/cat.png"]
