"""Images in, as vLLM's users send them: the Qwen2-VL processor against transformers', image
loading (data, http, file URLs), the input processor's admission (placeholder counts,
``limit_mm_per_prompt``, text-only models, the context length), chat image parts, and the
OpenAI server's chat route with images, end to end on a tiny checkpoint."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from fixtures_qwen2_vl import (
    hf_greedy_with_images,
    hf_inputs,
    random_image,
    save_tiny_qwen2_vl,
)
from PIL import Image

from chassis.core.beam_search import BeamSearchParams
from chassis.core.chat import ChatMessageError, render_chat
from chassis.core.chat_media import ChatImages
from chassis.core.config import EngineConfig
from chassis.core.engine_setup import finalize_config
from chassis.core.image_loading import ImageLoader, fetch_timeout
from chassis.core.input_processor import InputProcessor
from chassis.core.request import EngineCoreRequest
from chassis.core.sampling_params import SamplingParams
from chassis.core.tokenizer import engine_tokenizer, eos_token_ids

PAD = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT_1 = f"<|im_start|>user\n{PAD}What is this?<|im_end|>\n<|im_start|>assistant\n"
PROMPT_2 = f"Compare {PAD} with {PAD} please."


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"), "qwen2_vl")


def _input_processor(model_dir: Path, **settings: Any) -> InputProcessor:
    """The input processor an ``LLM`` of ``model_dir`` builds (no engine)."""
    config = EngineConfig(model=str(model_dir), max_model_len=settings.pop("max_model_len", 256))
    for name, value in settings.items():
        setattr(config, name, value)
    finalize_config(config)
    if config.skip_tokenizer_init:
        return InputProcessor(None, config, [0], vocab_size=49160)
    tokenizer = engine_tokenizer(config)
    return InputProcessor(tokenizer, config, eos_token_ids(tokenizer, config.model))


@pytest.fixture(scope="module")
def vl_processor(vl_dir: Path) -> InputProcessor:
    return _input_processor(vl_dir)


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image)).decode()


# -- the Qwen2-VL processor against transformers ----------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "sizes"),
    [(PROMPT_1, [(70, 90)]), (PROMPT_2, [(56, 56), (100, 130)])],
    ids=["one_image", "two_images"],
)
def test_expanded_prompt_and_pixels_equal_transformers(
    vl_dir: Path, vl_processor: InputProcessor, prompt: str, sizes: list[tuple[int, int]]
) -> None:
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    [request] = vl_processor.process(
        prompt,
        SamplingParams(max_tokens=4),
        "r",
        multi_modal_data={"image": images if len(images) > 1 else images[0]},
    )
    hf = hf_inputs(vl_dir, prompt, images)
    assert request.prompt_token_ids == hf["input_ids"][0].tolist()
    features = request.mm_features
    assert [f.modality for f in features] == ["image"] * len(images)
    tensors = [f.tensors() for f in features]
    pixels = torch.cat([t["pixel_values"] for t in tensors])
    grids = torch.cat([t["image_grid_thw"] for t in tensors])
    assert torch.equal(pixels, hf["pixel_values"]) and pixels.dtype == torch.float32
    assert torch.equal(grids, hf["image_grid_thw"])
    image_id = vl_processor.multimodal.processor().placeholder_token_ids["image"]
    ids = request.prompt_token_ids
    for feature, grid in zip(features, grids, strict=True):
        assert feature.length == int(grid.prod()) // 4  # merge 2
        assert ids[feature.offset : feature.end] == [image_id] * feature.length
        assert ids[feature.offset - 1] != image_id and ids[feature.end] != image_id
    # different images differ in identity; the same image has the same one
    [again] = vl_processor.process(
        prompt, SamplingParams(max_tokens=4), "r2", multi_modal_data={"image": images}
    )
    assert [f.identifier for f in again.mm_features] == [f.identifier for f in features]
    assert len({f.identifier for f in features}) == len(features)


def test_qwen2_5_vl_checkpoints_take_the_same_processor(tmp_path: Path) -> None:
    """Qwen2.5-VL's config (its own vision config class) builds the processor too."""
    import transformers

    from chassis.builtin_plugins.models.qwen2_vl_processing import Qwen2VLImageInputs
    from chassis.core.model_loader import load_hf_config

    model_dir = save_tiny_qwen2_vl(tmp_path / "qwen2_5_vl", "qwen2_5_vl")
    processor = Qwen2VLImageInputs.from_pretrained(model_dir, load_hf_config(model_dir))
    images = [random_image(84, 56, seed=1), random_image(112, 112, seed=2)]
    hf = hf_inputs(model_dir, PROMPT_2, images)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids, features = processor.process(tokenizer(PROMPT_2).input_ids, {"image": images})
    assert ids == hf["input_ids"][0].tolist()
    pixels = torch.cat([f.tensors()["pixel_values"] for f in features])
    assert torch.equal(pixels, hf["pixel_values"])
    with pytest.raises(ValueError, match=r"no preprocessor_config\.json"):
        Qwen2VLImageInputs.from_pretrained(tmp_path, load_hf_config(model_dir))


def test_token_id_prompts_and_processor_kwargs(vl_dir: Path, vl_processor: InputProcessor) -> None:
    """A prompt of token ids with one placeholder id per image expands as text does;
    ``mm_processor_kwargs`` ``max_pixels`` shrinks the image as transformers' ``size`` does."""
    image = random_image(112, 112, seed=3)
    params = SamplingParams(max_tokens=4)
    tokenizer = vl_processor.tokenizer
    ids = tokenizer(PROMPT_1).input_ids
    [from_ids] = vl_processor.process(ids, params, "a", multi_modal_data={"image": [image]})
    [from_text] = vl_processor.process(PROMPT_1, params, "b", multi_modal_data={"image": image})
    assert from_ids.prompt_token_ids == from_text.prompt_token_ids
    assert from_ids.mm_features[0].length == 16  # 112 px = 8 patches a side, merged 2x2
    [small] = vl_processor.process(
        PROMPT_1,
        params,
        "c",
        multi_modal_data={"image": image},
        mm_processor_kwargs={"max_pixels": 56 * 56},
    )
    import transformers

    hf = transformers.AutoImageProcessor.from_pretrained(vl_dir)(
        images=[image],
        size={"shortest_edge": 56 * 56, "longest_edge": 56 * 56},
        return_tensors="pt",
    )
    assert small.mm_features[0].length == 4
    assert torch.equal(small.mm_features[0].tensors()["pixel_values"], hf["pixel_values"])
    for kwargs, match in (
        ({"num_frames": 2}, "num_frames not supported"),
        ({"max_pixels": 0}, "integer > 0"),
        ({"min_pixels": 9000, "max_pixels": 3000}, "must not exceed"),
    ):
        with pytest.raises(ValueError, match=match):
            vl_processor.process(
                PROMPT_1, params, "d", multi_modal_data={"image": image}, mm_processor_kwargs=kwargs
            )
    # without images they are ignored, as vLLM ignores them
    [text] = vl_processor.process("Hi", params, "e", mm_processor_kwargs={"max_pixels": 3136})
    assert text.mm_features == []


def test_placeholder_counts_must_match_the_images(vl_processor: InputProcessor) -> None:
    params = SamplingParams(max_tokens=4)
    two = [random_image(56, 56, seed=1), random_image(56, 56, seed=2)]
    with pytest.raises(ValueError, match=r"has 1 image placeholder.*but 2 image\(s\)"):
        vl_processor.process(PROMPT_1, params, "a", multi_modal_data={"image": two})
    with pytest.raises(ValueError, match=r"has 2 image placeholder.*but 1 image\(s\)"):
        vl_processor.process(PROMPT_2, params, "b", multi_modal_data={"image": two[0]})
    with pytest.raises(ValueError, match=r"has 0 image placeholder"):
        vl_processor.process("no placeholder", params, "c", multi_modal_data={"image": two[0]})
    # no item at all: the prompt is taken as text, as without multi_modal_data
    [plain] = vl_processor.process(PROMPT_1, params, "d", multi_modal_data={"image": []})
    assert plain.mm_features == []
    with pytest.raises(ValueError, match=r"must be a PIL\.Image\.Image"):
        vl_processor.process(PROMPT_1, params, "e", multi_modal_data={"image": [[1, 2]]})
    with pytest.raises(ValueError, match=r"has 0 video placeholder.*but 1 video\(s\)"):
        vl_processor.process(PROMPT_1, params, "f", multi_modal_data={"video": [two[0]]})
    with pytest.raises(ValueError, match="unknown modality 'picture'"):
        vl_processor.process(PROMPT_1, params, "g", multi_modal_data={"picture": two[0]})
    with pytest.raises(ValueError, match="multi_modal_data must be a dict"):
        vl_processor.process(PROMPT_1, params, "h", multi_modal_data=[two[0]])  # type: ignore[arg-type]


def test_limit_mm_per_prompt_and_context_length(vl_dir: Path) -> None:
    images = [random_image(56, 56, seed=i) for i in range(2)]
    params = SamplingParams(max_tokens=2)
    limited = _input_processor(vl_dir, limit_mm_per_prompt={"image": 1})
    limited.process(PROMPT_1, params, "text")
    assert limited.multimodal._processor is None  # built by the first request with images
    with pytest.raises(ValueError, match=r"At most 1 image\(s\) may be provided in one prompt"):
        limited.process(PROMPT_2, params, "a", multi_modal_data={"image": images})
    assert limited.process(PROMPT_1, params, "b", multi_modal_data={"image": images[0]})
    built = limited.multimodal._processor
    assert built is not None
    limited.process(PROMPT_1, params, "b2", multi_modal_data={"image": images[1]})
    assert limited.multimodal.processor() is built  # once
    none = _input_processor(vl_dir, limit_mm_per_prompt={"image": {"count": 0}})
    with pytest.raises(ValueError, match=r"At most 0 image\(s\)"):
        none.process(PROMPT_1, params, "c", multi_modal_data={"image": images[0]})
    for bad, match in (
        ({"image": -1}, "integer >= 0"),
        ({"picture": 1}, "unknown modality 'picture'"),
        ([1], "JSON object"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineConfig(limit_mm_per_prompt=bad)  # type: ignore[arg-type]
    # an image's 16 tokens push the prompt over the context: the length check counts them
    short = _input_processor(vl_dir, max_model_len=24)
    big = random_image(112, 112)
    with pytest.raises(ValueError, match=r"maximum context length is 24 tokens.*16 of them"):
        short.process(PROMPT_1, params, "d", multi_modal_data={"image": big})
    with pytest.raises(ValueError, match=r"maximum context length is 24 tokens"):
        short.process(PAD + "x", SamplingParams(max_tokens=8), "e", multi_modal_data={"image": big})


def test_truncation_n_and_msgspec_round_trip(vl_processor: InputProcessor) -> None:
    image = random_image(56, 56)
    text = "one two three four five " + PAD + " end"
    [full] = vl_processor.process(
        text, SamplingParams(max_tokens=2), "a", multi_modal_data={"image": image}
    )
    offset = full.mm_features[0].offset
    keep = len(full.prompt_token_ids) - 2
    [cut] = vl_processor.process(
        text,
        SamplingParams(max_tokens=2, truncate_prompt_tokens=keep),
        "b",
        multi_modal_data={"image": image},
    )
    assert cut.prompt_token_ids == full.prompt_token_ids[2:]
    assert cut.mm_features[0].offset == offset - 2
    with pytest.raises(ValueError, match="placeholder tokens of its first image"):
        vl_processor.process(
            text,
            SamplingParams(
                max_tokens=2, truncate_prompt_tokens=len(full.prompt_token_ids) - offset - 1
            ),
            "c",
            multi_modal_data={"image": image},
        )
    children = vl_processor.process(
        text, SamplingParams(max_tokens=2, n=2), "d", multi_modal_data={"image": image}
    )
    assert [c.mm_features for c in children] == [full.mm_features] * 2
    wire = msgspec.msgpack.encode(children[0])
    back = msgspec.msgpack.decode(wire, type=EngineCoreRequest)
    assert back.prompt_token_ids == full.prompt_token_ids
    assert back.mm_features == full.mm_features
    for name, tensor in full.mm_features[0].tensors().items():
        assert torch.equal(back.mm_features[0].tensors()[name], tensor)


def test_text_only_models_and_engines_without_a_tokenizer_refuse_images(
    tiny_llama_dir: Path, vl_dir: Path
) -> None:
    image = random_image(56, 56)
    params = SamplingParams(max_tokens=2)
    text_only = _input_processor(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"\(LlamaForCausalLM\) takes text only"):
        text_only.process("a <x> b", params, "a", multi_modal_data={"image": image})
    [plain] = text_only.process("a b", params, "b")  # text still runs
    assert plain.mm_features == []
    no_tokenizer = _input_processor(vl_dir, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="need the model's tokenizer"):
        no_tokenizer.process([1, 49154, 2], params, "c", multi_modal_data={"image": image})
    # a --tokenizer without the model's vision tokens cannot place the images
    config = EngineConfig(model=str(vl_dir), tokenizer=str(tiny_llama_dir), max_model_len=64)
    finalize_config(config)
    foreign = engine_tokenizer(config)
    other = InputProcessor(foreign, config, [2])
    with pytest.raises(ValueError, match="need the model's own tokenizer"):
        other.process(PROMPT_1, params, "d", multi_modal_data={"image": image})


# -- image loading ---------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}

    def do_GET(self) -> None:
        if self.path == "/slow.png":
            time.sleep(1.0)
        body = self.files.get(self.path.removeprefix("/slow"))
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    """A local http server of ``/cat.png``, ``/text.png`` (not an image) and ``/slow.png``
    (``/cat.png`` after a second)."""
    _Handler.files = {"/cat.png": _png(random_image(40, 50, seed=7)), "/text.png": b"hello"}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_image_sources(image_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cat = random_image(40, 50, seed=7)
    loader = ImageLoader()
    from_data = loader.load(_data_url(cat))
    assert from_data.mode == "RGB" and from_data.tobytes() == cat.tobytes()
    assert loader.load(f"{image_server}/cat.png").tobytes() == cat.tobytes()
    # transparency becomes white (transformers' and vLLM's conversion), grey becomes RGB
    clear = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert loader.load(clear).getpixel((0, 0)) == (255, 255, 255)
    assert loader.load(Image.new("L", (4, 4), 7)).getpixel((0, 0)) == (7, 7, 7)
    for source, match in (
        ("data:image/png;base64,@@@", "invalid base64"),
        ("data:image/png;base64," + base64.b64encode(b"not a picture").decode(), "not an image"),
        ("data:text/plain;base64,aGk=", "not an image/ type"),
        ("data:image/png,rawbytes", "only base64 data URLs"),
        (f"{image_server}/text.png", "not an image"),
        (f"{image_server}/missing.png", "HTTP 404"),
        ("ftp://example.com/cat.png", "unsupported scheme 'ftp'"),
        ("cat.png", "unsupported scheme"),
        (42, "PIL.Image.Image or a URL"),
    ):
        with pytest.raises(ValueError, match=match):
            loader.load(source)
    with pytest.raises(ValueError, match=r"no answer within 0.2 s \(\$VLLM_IMAGE_FETCH_TIMEOUT\)"):
        ImageLoader(timeout_s=0.2).load(f"{image_server}/slow.png")
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "0.5")
    assert fetch_timeout() == 0.5 and ImageLoader().timeout_s == 0.5
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="VLLM_IMAGE_FETCH_TIMEOUT"):
        ImageLoader()
    monkeypatch.delenv("VLLM_IMAGE_FETCH_TIMEOUT")

    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(_png(cat))
    (tmp_path / "secret.png").write_bytes(_png(cat))
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    url = (allowed / "cat.png").as_uri()
    with pytest.raises(ValueError, match="--allowed-local-media-path"):
        loader.load(url)  # no folder allowed: no local files
    local = ImageLoader(str(allowed))
    assert local.load(url).tobytes() == cat.tobytes()
    for outside in (
        (tmp_path / "secret.png").as_uri(),
        (allowed / "link.png").as_uri(),  # a link out of the folder
        f"file://{allowed}/../secret.png",
    ):
        with pytest.raises(ValueError, match="must lie under --allowed-local-media-path"):
            local.load(outside)
    with pytest.raises(ValueError, match="cannot be read"):
        local.load((allowed / "gone.png").as_uri())
    with pytest.raises(ValueError, match="not an existing folder"):
        ImageLoader(str(tmp_path / "nowhere"))


# -- chat image parts ------------------------------------------------------------------------


def _chat_images(processor: InputProcessor, folder: str = "") -> ChatImages:
    return ChatImages(processor.multimodal, ImageLoader(folder))


def test_chat_image_parts_render_through_the_template(vl_processor: InputProcessor) -> None:
    cat = random_image(40, 50, seed=7)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": _data_url(cat)}},
                {"type": "image_pil", "image_pil": cat},
            ],
        }
    ]
    chat_images = _chat_images(vl_processor)
    marked, images, placeholder = chat_images.extract(messages)
    assert placeholder == PAD and len(images) == 2
    assert images[0].tobytes() == images[1].tobytes() == cat.tobytes()
    assert messages[0]["content"][1]["type"] == "image_url"  # the input is not modified
    tokenizer = vl_processor.tokenizer
    text = render_chat(tokenizer, marked, image_placeholder=placeholder)  # "auto": openai
    assert text == f"<|im_start|>user\nLook:{PAD}{PAD}<|im_end|>\n<|im_start|>assistant\n"
    # a template that takes content as one string gets the placeholders before the text
    string_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    text = render_chat(tokenizer, marked, chat_template=string_template, image_placeholder=PAD)
    assert text == f"[{PAD}\n{PAD}\nLook:]"
    # without images taken (another route, an engine without them) the part is refused
    with pytest.raises(ChatMessageError, match="only text parts"):
        render_chat(tokenizer, messages)
    for part, match in (
        ({"type": "video_url", "video_url": {"url": "x"}}, r"content\[0\]: video_url parts"),
        ({"type": "image"}, "an image part needs its image"),
        ({"type": "image_url", "image_url": {}}, "needs a URL"),
        ({"type": "image_pil", "image_pil": "x"}, r"PIL\.Image\.Image"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}, "base64"),
    ):
        with pytest.raises(ChatMessageError, match=match):
            chat_images.extract([{"role": "user", "content": [part]}])


def test_chat_checks_the_engine_before_loading(tiny_llama_dir: Path, vl_dir: Path) -> None:
    """A text-only model and a count over the limit are refused before any URL is fetched
    (port 9 of this host serves nothing: a fetch would fail otherwise)."""
    unreachable = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}
    one = [{"role": "user", "content": [unreachable]}]
    text_only = _chat_images(_input_processor(tiny_llama_dir))
    with pytest.raises(ChatMessageError, match=r"only text parts are supported \(model .* takes"):
        text_only.extract(one)
    limited = _chat_images(_input_processor(vl_dir, limit_mm_per_prompt={"image": 1}))
    with pytest.raises(ChatMessageError, match=r"At most 1 image\(s\)"):
        limited.extract([{"role": "user", "content": [unreachable, unreachable]}])
    with pytest.raises(ChatMessageError, match="fetch failed"):
        limited.extract(one)


# -- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_answer(vl_dir: Path) -> list[int]:
    return hf_greedy_with_images(vl_dir, PROMPT_1, [random_image(56, 84, seed=5)], 4)


@pytest.mark.timeout(300)
def test_server_chat_with_images(
    vl_dir: Path, hf_answer: list[int], image_server: str, tmp_path: Path
) -> None:
    """The chat route over a real engine: an image as a data, http or file URL gets HF's
    greedy answer; bad images, too many images and beam search are 400s in OpenAI's shape."""
    from fastapi.testclient import TestClient

    from chassis.core.async_llm import AsyncLLM
    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    image = random_image(56, 84, seed=5)
    (tmp_path / "img.png").write_bytes(_png(image))
    _Handler.files["/img.png"] = _png(image)
    engine = AsyncLLM.from_engine_config(
        EngineConfig(
            model=str(vl_dir),
            dtype="float32",
            max_model_len=128,
            num_kv_blocks=64,
            limit_mm_per_prompt={"image": 2},
            allowed_local_media_path=str(tmp_path),
        )
    )

    def chat(*parts: dict[str, Any], **extra: Any) -> Any:
        """The images, then the question: PROMPT_1 once rendered."""
        body = {
            "messages": [
                {"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}
            ],
            "max_tokens": 4,
            "temperature": 0,
            "return_token_ids": True,
            **extra,
        }
        return client.post("/v1/chat/completions", json=body)

    def image_url(url: str) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": url}}

    try:
        with TestClient(build_app(engine, ServerSettings(shutdown_engine_on_exit=False))) as client:
            for url in (
                _data_url(image),
                f"{image_server}/img.png",
                (tmp_path / "img.png").as_uri(),
            ):
                answer = chat(image_url(url))
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["token_ids"] == hf_answer
            for parts, extra, param, match in (
                ([image_url("data:image/png;base64,@@")], {}, "messages.0.content", "base64"),
                ([image_url(_data_url(image))] * 3, {}, "messages.0.content", "At most 2"),
                ([image_url("file:///etc/hostname")], {}, "messages.0.content", "must lie under"),
                (
                    [image_url(_data_url(image))],
                    {"use_beam_search": True, "n": 2},
                    "use_beam_search",
                    "beam",
                ),
                (
                    [image_url(_data_url(image))],
                    {"mm_processor_kwargs": {"num_frames": 1}},
                    None,
                    "num_frames",
                ),
            ):
                refused = chat(*parts, **extra)
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert error["type"] == "invalid_request_error" and match in error["message"]
                if param is not None:
                    assert error["param"] == param
            streamed = chat(image_url(_data_url(image)), stream=True)
            assert streamed.status_code == 200
            events = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
            ids = [
                i
                for e in events
                for c in json.loads(e[6:])["choices"]
                for i in c.get("token_ids") or []
            ]
            assert ids == hf_answer
            # with usage in every chunk, the role chunk too counts the expanded prompt (it
            # waits for the engine's count: the front-end's is before the images expand)
            usage_stream = chat(
                image_url(_data_url(image)),
                stream=True,
                return_token_ids=False,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
            )
            chunks = [
                json.loads(line[6:])
                for line in usage_stream.text.splitlines()
                if line.startswith("data: {")
            ]
            prompt_tokens = {c["usage"]["prompt_tokens"] for c in chunks if c.get("usage")}
            expected = chunks[-1]["usage"]["prompt_tokens"]
            assert expected == hf_inputs(vl_dir, PROMPT_1, [image])["input_ids"].shape[1]
            assert prompt_tokens == {expected}
            assert "prompt_token_ids" not in chunks[0]
            text = client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            )
            assert text.status_code == 200  # still serving
    finally:
        engine.shutdown_sync()


@pytest.mark.timeout(300)
def test_llm_generate_and_chat_with_images(vl_dir: Path, hf_answer: list[int]) -> None:
    from chassis.core.llm import LLM

    image = random_image(56, 84, seed=5)
    llm = LLM(str(vl_dir), dtype="float32", max_model_len=128, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    [out] = llm.generate({"prompt": PROMPT_1, "multi_modal_data": {"image": image}}, params)
    assert list(out.outputs[0].token_ids) == hf_answer
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": image},
                {"type": "text", "text": "What is this?"},
            ],
        }
    ]
    [chatted] = llm.chat(messages, params)
    assert chatted.prompt == PROMPT_1
    assert list(chatted.outputs[0].token_ids) == hf_answer
    with pytest.raises(ValueError, match=r"generate\(\) and chat\(\) only"):
        llm.beam_search(
            {"prompt": PROMPT_1, "multi_modal_data": {"image": image}},
            BeamSearchParams(beam_width=2, max_tokens=2),
        )
