"""Chat ``video_url`` parts for Qwen2-VL / Qwen2.5-VL: PyAV decoding and vLLM's frame
sampling, the chat media path (markers, admission before any fetch, refusals naming the
part), ``LLM.chat`` against ``LLM.generate`` with the same frames and timing, and the
server's chat route, on tiny random checkpoints (tests/fixtures_qwen2_vl.py).

The videos are encoded here with PyAV, losslessly (H.264 RGB at crf 0 in MP4, which records
its frame count; FFV1 in Matroska, which does not): decoded frames must equal the encoded
ones exactly.
"""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures_llava import save_tiny_llava
from fixtures_qwen2_vl import random_image, save_tiny_qwen2_vl

from chassis.core.chat import ChatMessageError, render_chat
from chassis.core.chat_media import ChatImages
from chassis.core.config import EngineConfig
from chassis.core.engine_setup import finalize_config
from chassis.core.image_loading import ImageLoader
from chassis.core.input_processor import InputProcessor
from chassis.core.multimodal_inputs import sampled_fps, video_frames_and_metadata
from chassis.core.sampling_params import SamplingParams
from chassis.core.tokenizer import engine_tokenizer, eos_token_ids
from chassis.core.video_loading import (
    DEFAULT_NUM_FRAMES,
    VideoLoader,
    decode_video,
    fetch_timeout,
    sample_frame_indices,
)

pytest.importorskip("av")

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QUESTION = "What happens?"
PROMPT = f"<|im_start|>user\n{VIDEO}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
#: the test video: 10 frames of 56x56 at 4 frames per second (2.5 s)
NUM_FRAMES, FPS, SIDE = 10, 4, 56


def random_frames(count: int = NUM_FRAMES, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count, SIDE, SIDE, 3), dtype=np.uint8)


def encode_video(frames: np.ndarray, container: str = "mp4", fps: int = FPS) -> bytes:
    """``frames`` encoded losslessly: H.264 RGB at crf 0 in MP4, or FFV1 in Matroska."""
    import av

    codec, pix_fmt, options = {
        "mp4": ("libx264rgb", "rgb24", {"crf": "0"}),
        "matroska": ("ffv1", "bgr0", {}),
    }[container]
    out = io.BytesIO()
    with av.open(out, "w", format=container) as video:
        stream = video.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], pix_fmt
        stream.options = options
        for frame in frames:
            video.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        video.mux(stream.encode())
    return out.getvalue()


def data_url(data: bytes, media_type: str = "video/mp4") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def video_part(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


@pytest.fixture(scope="module")
def frames() -> np.ndarray:
    return random_frames()


@pytest.fixture(scope="module")
def mp4(frames: np.ndarray) -> bytes:
    return encode_video(frames)


# -- decoding and sampling -------------------------------------------------------------------


def test_sampling_is_vllms_uniform_linspace() -> None:
    assert sample_frame_indices(10, 4) == [0, 3, 6, 9]
    assert sample_frame_indices(100, 32) == np.linspace(0, 99, 32).astype(int).tolist()
    assert sample_frame_indices(10, 32) == sample_frame_indices(10, -1) == list(range(10))
    assert DEFAULT_NUM_FRAMES == 32


@pytest.mark.parametrize("container", ["mp4", "matroska"])
def test_decoded_frames_equal_the_encoded_ones(frames: np.ndarray, container: str) -> None:
    """Every frame, then 4 sampled: pixel-exact, with the video's timing as metadata (the
    Matroska file records no frame count: its packets are counted)."""
    data = encode_video(frames, container)
    decoded, metadata = decode_video(data, "the test video", num_frames=-1)
    np.testing.assert_array_equal(decoded, frames)
    assert metadata == {
        "total_num_frames": NUM_FRAMES,
        "fps": FPS,
        "duration": NUM_FRAMES / FPS,
        "frames_indices": list(range(NUM_FRAMES)),
        "video_backend": "pyav",
    }
    sampled, metadata = VideoLoader(num_frames=4).load(data_url(data))
    np.testing.assert_array_equal(sampled, frames[[0, 3, 6, 9]])
    assert metadata["frames_indices"] == [0, 3, 6, 9]
    assert metadata["total_num_frames"] == NUM_FRAMES
    # transformers' sampled fps: 4 frames of 10 at 4 fps
    assert sampled_fps(metadata) == pytest.approx(1.6)


def test_default_loader_keeps_32_frames() -> None:
    long = random_frames(40, seed=3)
    sampled, metadata = VideoLoader().load(data_url(encode_video(long)))
    expected = np.linspace(0, 39, 32).astype(int).tolist()
    assert metadata["frames_indices"] == expected
    np.testing.assert_array_equal(sampled, long[expected])


def test_video_sources_and_refusals(
    mp4: bytes, frames: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "clip.mp4").write_bytes(mp4)
    local = VideoLoader(tmp_path.resolve(), num_frames=-1)
    np.testing.assert_array_equal(local.load((tmp_path / "clip.mp4").as_uri())[0], frames)
    for url, match in (
        (data_url(b"not a video at all"), "is not a video that can be read"),
        (data_url(mp4, "image/png"), "not a video/ type"),
        ("data:video/mp4;base64,@@", "invalid base64"),
        ("data:video/jpeg;base64,AAAA,BBBB", "data:video/jpeg"),
        ("ftp://host/x.mp4", "unsupported scheme 'ftp'"),
        ((tmp_path / "clip.mp4").as_uri(), "--allowed-local-media-path"),
    ):
        with pytest.raises(ValueError, match=match):
            VideoLoader().load(url)
    with pytest.raises(ValueError, match="holds no video stream"):
        VideoLoader().load(data_url(_audio_only()))
    with pytest.raises(ValueError, match="num_frames"):
        VideoLoader(num_frames=0)
    from PIL import Image

    with monkeypatch.context() as patch:  # frames of more pixels than PIL decodes
        patch.setattr(Image, "MAX_IMAGE_PIXELS", SIDE * SIDE // 2 - 1)
        with pytest.raises(ValueError, match="too large to decode"):
            VideoLoader().load(data_url(mp4))
    monkeypatch.setenv("VLLM_VIDEO_FETCH_TIMEOUT", "2.5")
    assert fetch_timeout() == 2.5 and VideoLoader().timeout_s == 2.5
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV not installed
    with pytest.raises(ValueError, match="pip install av"):
        VideoLoader().load(data_url(mp4))


def _audio_only() -> bytes:
    """A WAV file: a container PyAV opens, with no video stream."""
    import wave

    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(8000)
        wav.writeframes(b"\0\0" * 800)
    return out.getvalue()


def test_video_items_with_metadata() -> None:
    video = random_frames(2)
    assert video_frames_and_metadata(video) == (video, None)
    frames, metadata = video_frames_and_metadata((video, {"fps": 2.0}))
    assert frames is video and sampled_fps(metadata) == 2.0
    for metadata, match in (
        ({"fps": 0}, "'fps' must be a number > 0"),
        ({"total_num_frames": 0}, "total_num_frames"),
        ({"frames_indices": 3}, "frames_indices"),
    ):
        with pytest.raises(ValueError, match=match):
            video_frames_and_metadata((video, metadata))


# -- chat parts ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_5_vl"), "qwen2_5_vl")


def _chat_media(model_dir: Path, **settings: Any) -> ChatImages:
    """The chat media taker an ``LLM`` of ``model_dir`` builds (no engine)."""
    config = EngineConfig(model=str(model_dir), max_model_len=256)
    for name, value in settings.items():
        setattr(config, name, value)
    finalize_config(config)
    tokenizer = engine_tokenizer(config)
    processor = InputProcessor(tokenizer, config, eos_token_ids(tokenizer, config.model))
    return ChatImages(processor.multimodal, ImageLoader(config.allowed_local_media_path))


def test_chat_video_parts_render_through_the_template(vl_dir: Path, mp4: bytes) -> None:
    image = random_image(56, 56, seed=1)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                video_part(data_url(mp4)),
                {"type": "image_pil", "image_pil": image},
            ],
        }
    ]
    taker = _chat_media(vl_dir)
    media = taker.extract_media(messages)
    assert (media.image_placeholder, media.video_placeholder) == (IMAGE, VIDEO)
    [(frames, metadata)] = media.videos
    assert frames.shape == (NUM_FRAMES, SIDE, SIDE, 3) and metadata["fps"] == FPS
    assert media.multi_modal_data() == {"image": media.images, "video": media.videos}
    assert messages[0]["content"][1]["type"] == "video_url"  # the input is not modified
    tokenizer = taker.multimodal.tokenizer
    kwargs = {"image_placeholder": IMAGE, "video_placeholder": VIDEO}
    text = render_chat(tokenizer, media.messages, **kwargs)  # "auto": openai
    assert text == f"<|im_start|>user\nLook:{VIDEO}{IMAGE}<|im_end|>\n<|im_start|>assistant\n"
    string_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    text = render_chat(tokenizer, media.messages, chat_template=string_template, **kwargs)
    assert text == f"[{VIDEO}\n{IMAGE}\nLook:]"  # vLLM's rule: kinds in order of first part
    # without videos taken (/tokenize, /v1/responses) the part is refused naming the routes
    with pytest.raises(ChatMessageError, match=r"content\[1\]: video_url parts are taken by"):
        taker.extract(messages)
    for part, match in (
        ({"type": "video"}, "a video part needs its video"),
        ({"type": "video_url", "video_url": {}}, "a video_url part needs a URL"),
        (video_part(data_url(b"junk")), r"content\[0\]: the data URL .* is not a video"),
    ):
        with pytest.raises(ChatMessageError, match=match):
            taker.extract_media([{"role": "user", "content": [part]}])


def test_chat_checks_the_engine_before_loading(
    tiny_llama_dir: Path, vl_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Models that take no video, a count over the limit and a missing PyAV are refused
    naming the part before any URL is fetched (port 9 of this host serves nothing: a fetch
    would fail otherwise)."""
    unreachable = video_part("http://127.0.0.1:9/x.mp4")
    text = {"type": "text", "text": "Hi"}
    one = [{"role": "user", "content": [text, unreachable]}]
    with pytest.raises(ChatMessageError, match=r"content\[1\]: only text parts are supported"):
        _chat_media(tiny_llama_dir).extract_media(one)
    images_only = save_tiny_llava(tmp_path / "llava")
    with pytest.raises(
        ChatMessageError,
        match=r"content\[1\]: only text and image parts are supported \(model .* takes image "
        "inputs, not video",
    ):
        _chat_media(images_only).extract_media(one)
    limited = _chat_media(vl_dir, limit_mm_per_prompt={"video": 1})
    with pytest.raises(ChatMessageError, match=r"At most 1 video\(s\)"):
        limited.extract_media([{"role": "user", "content": [unreachable, unreachable]}])
    with pytest.raises(ChatMessageError, match="fetch failed"):
        limited.extract_media(one)
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(ChatMessageError, match=r"content\[1\]: video inputs need PyAV"):
        limited.extract_media(one)


# -- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def offline(vl_dir: Path, mp4: bytes, frames: np.ndarray) -> dict[str, Any]:
    """``LLM.chat`` with the video as a data URL (4 of its frames kept), and ``LLM.generate``
    with those frames at their sampled rate, at the default rate, and as a ``(frames,
    metadata)`` item; and all 10 frames at their rate (what the server's loader keeps)."""
    from chassis.core.llm import LLM

    llm = LLM(str(vl_dir), dtype="float32", max_model_len=128, num_kv_blocks=64)
    llm._chat_images.video_loader = VideoLoader(num_frames=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    messages = [
        {"role": "user", "content": [video_part(data_url(mp4)), {"type": "text", "text": QUESTION}]}
    ]
    kept = frames[[0, 3, 6, 9]]
    try:
        [chatted] = llm.chat(messages, params)
        generated = llm.generate(
            [
                {
                    "prompt": PROMPT,
                    "multi_modal_data": {"video": kept},
                    "mm_processor_kwargs": {"fps": 1.6},
                },
                {"prompt": PROMPT, "multi_modal_data": {"video": kept}},
                {"prompt": PROMPT, "multi_modal_data": {"video": (kept, {"fps": 1.6})}},
                {
                    "prompt": PROMPT,
                    "multi_modal_data": {"video": frames},
                    "mm_processor_kwargs": {"fps": FPS},
                },
            ],
            params,
        )
    finally:
        llm.shutdown()
    names = ("at_sampled_fps", "at_24", "item", "all_frames")
    return {"chat": chatted, **dict(zip(names, generated, strict=True))}


def _logprobs(output: Any) -> list[float]:
    completion = output.outputs[0]
    return [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)]


@pytest.mark.timeout(300)
def test_llm_chat_equals_generate_with_the_same_frames_and_fps(offline: dict[str, Any]) -> None:
    chatted, same = offline["chat"], offline["at_sampled_fps"]
    assert chatted.prompt == PROMPT
    assert list(chatted.prompt_token_ids) == list(same.prompt_token_ids)
    assert list(chatted.outputs[0].token_ids) == list(same.outputs[0].token_ids)
    assert _logprobs(chatted) == pytest.approx(_logprobs(same), abs=1e-5)
    assert _logprobs(offline["item"]) == pytest.approx(_logprobs(same), abs=1e-5)
    # the timing matters (Qwen2.5-VL's temporal positions): 24 fps answers otherwise
    assert _logprobs(offline["at_24"]) != pytest.approx(_logprobs(same), abs=1e-5)


@pytest.mark.timeout(300)
def test_server_chat_with_videos(
    vl_dir: Path,
    mp4: bytes,
    offline: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chat route over a real engine: a video as a data or file URL (10 frames: every
    one kept) gets ``LLM.generate``'s greedy answer for its frames at 4 fps, its usage
    counting the expanded video; bad videos, too many, no PyAV, /tokenize and beam search
    are 400s in OpenAI's shape."""
    from fastapi.testclient import TestClient

    from chassis.core.async_llm import AsyncLLM
    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    (tmp_path / "clip.mp4").write_bytes(mp4)
    engine = AsyncLLM.from_engine_config(
        EngineConfig(
            model=str(vl_dir),
            dtype="float32",
            max_model_len=128,
            num_kv_blocks=64,
            limit_mm_per_prompt={"video": 1},
            allowed_local_media_path=str(tmp_path),
        )
    )

    def chat(*parts: dict[str, Any], route: str = "/v1/chat/completions", **extra: Any) -> Any:
        body = {
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}],
            "max_tokens": 4,
            "temperature": 0,
            "return_token_ids": True,
            **extra,
        }
        return client.post(route, json=body)

    try:
        with TestClient(build_app(engine, ServerSettings(shutdown_engine_on_exit=False))) as client:
            answers = []
            for url in (data_url(mp4), (tmp_path / "clip.mp4").as_uri()):
                answer = chat(video_part(url))
                assert answer.status_code == 200, answer.text
                answers.append(answer.json())
            expected = offline["all_frames"]
            for answer in answers:
                assert answer["choices"][0]["token_ids"] == list(expected.outputs[0].token_ids)
                assert answer["prompt_token_ids"] == list(expected.prompt_token_ids)
            # 10 frames -> grid_t 5, 4x4 patches a frame -> 5 * 16 / 4 = 20 video tokens; the
            # chat offline kept 4 frames -> 8 tokens
            count = len(offline["chat"].prompt_token_ids) - 8 + 20
            assert answers[0]["usage"]["prompt_tokens"] == len(expected.prompt_token_ids) == count
            for parts, extra, param, match in (
                ([video_part(data_url(b"junk"))], {}, "messages.0.content", "not a video"),
                ([video_part(data_url(mp4))] * 2, {}, "messages.0.content", "At most 1 video"),
                ([video_part("file:///etc/hostname")], {}, "messages.0.content", "must lie under"),
                ([video_part("nope")], {}, "messages.0.content", "unsupported scheme"),
                (
                    [video_part(data_url(mp4))],
                    {"use_beam_search": True, "n": 2},
                    "use_beam_search",
                    "beam search does not take video inputs",
                ),
                (
                    [video_part(data_url(mp4))],
                    {"route": "/tokenize"},
                    "messages.0.content",
                    "video_url parts are taken by /v1/chat/completions and LLM.chat only",
                ),
            ):
                refused = chat(*parts, **extra)
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert match in error["message"] and error["param"] == param
            with monkeypatch.context() as patch:
                patch.setitem(sys.modules, "av", None)  # PyAV not installed
                refused = chat(video_part(data_url(mp4)))
            assert refused.status_code == 400
            assert "pip install av" in refused.json()["error"]["message"]
            streamed = chat(video_part(data_url(mp4)), stream=True)
            events = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
            ids = [
                i
                for e in events
                for c in json.loads(e[6:])["choices"]
                for i in c.get("token_ids") or []
            ]
            assert ids == list(expected.outputs[0].token_ids)
    finally:
        engine.shutdown_sync()
