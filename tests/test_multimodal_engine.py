"""Images through the engine core: prefix-cache keys, admission, the runner's encoder
outputs and M-RoPE positions, the tensor-parallel hand-over, and end to end against HF's
greedy tokens on the tiny Qwen2-VL / Qwen2.5-VL checkpoints (tests/fixtures_qwen2_vl.py)."""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np
import pytest
import torch
from mm_hf_compare import (
    ATOL,
    NUM_TOKENS,
    PARAMS,
    Answer,
    answers_and_cached,
    hf_generate,
    hf_image_text_model,
    media_prompts,
    small_llm,
)

from chassis.core.config import EngineConfig
from chassis.core.kv_cache_manager import KVCacheManager, hash_block_tokens, multimodal_block_keys
from chassis.core.multimodal import MultiModalFeature, make_feature
from chassis.core.multimodal_admission import multimodal_refusal
from chassis.core.multimodal_runner import MultiModalRunner
from chassis.core.request import Request
from chassis.core.sampling_params import SamplingParams
from chassis.core.scheduler_interface import NewRequestData, SchedulerOutput

IMAGE = 9  # the placeholder token id of the unit tests' prompts


def image_feature(offset: int, length: int, seed: int) -> MultiModalFeature:
    """An image of ``length`` placeholder tokens from ``offset``, its pixels from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        "pixel_values": torch.randn(4 * length, 6, generator=generator),
        "image_grid_thw": torch.tensor([[1, 2, 2 * length]]),
    }
    return make_feature("image", offset, length, tensors)


def image_prompt(before: int, length: int, after: int) -> list[int]:
    """``before`` text tokens, ``length`` placeholders, ``after`` text tokens."""
    return [*range(100, 100 + before), *[IMAGE] * length, *range(200, 200 + after)]


def mm_request(
    request_id: str, tokens: list[int], features: Sequence[MultiModalFeature] = ()
) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4), mm_features=list(features))


def admit(kv: KVCacheManager, request: Request) -> int:
    """Schedule the whole prompt after a prefix-cache lookup, count it computed, and free
    the request (its blocks stay cached); returns the hit tokens."""
    hits, num_hit = kv.get_computed_blocks(request)
    blocks = kv.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit)
    assert blocks is not None
    request.num_computed_tokens = request.num_tokens
    kv.free(request)
    return num_hit


# -- prefix cache ---------------------------------------------------------------------------


def test_block_keys_name_the_images_a_block_covers() -> None:
    first, second = image_feature(2, 5, seed=0), image_feature(9, 3, seed=1)  # 2..6, 9..11
    features = [first, second]
    assert multimodal_block_keys(features, 0, 2) == b""  # text before the image
    assert multimodal_block_keys(features, 7, 9) == b""  # text between the images
    only_first = multimodal_block_keys(features, 0, 4)
    assert first.identifier.encode() in only_first
    assert second.identifier.encode() not in only_first
    both = multimodal_block_keys(features, 4, 12)
    assert first.identifier.encode() in both and second.identifier.encode() in both
    # the same image, another part of it: another key
    assert multimodal_block_keys(features, 4, 8) != multimodal_block_keys(features, 0, 4)
    # a text block keys as before images existed
    assert hash_block_tokens(None, [1, 2], b"") == hash_block_tokens(None, [1, 2])


def test_the_same_tokens_with_another_image_do_not_share_its_blocks() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    prompt = image_prompt(before=8, length=8, after=6)  # blocks 0-1 text, 2-3 image, 4 text
    cat = image_feature(8, 8, seed=0)
    dog = image_feature(8, 8, seed=1)
    assert admit(kv, mm_request("cat", prompt, [cat])) == 0
    assert admit(kv, mm_request("cat again", prompt, [cat])) == 20  # every full block
    # another image: the text blocks before it hit, its own blocks and those after do not
    assert admit(kv, mm_request("dog", prompt, [dog])) == 8
    assert admit(kv, mm_request("dog again", prompt, [dog])) == 20
    # the same placeholder ids without an image are text: they share nothing with either
    assert admit(kv, mm_request("text", prompt)) == 8


def test_an_image_starting_inside_a_block_keys_that_block() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    prompt = image_prompt(before=6, length=4, after=6)  # the image: positions 6..9
    assert admit(kv, mm_request("a", prompt, [image_feature(6, 4, seed=0)])) == 0
    # block 1 (positions 4..7) holds the image's first half: only block 0 is shared
    assert admit(kv, mm_request("b", prompt, [image_feature(6, 4, seed=1)])) == 4
    assert admit(kv, mm_request("c", prompt, [image_feature(6, 4, seed=0)])) == 12


# -- admission ------------------------------------------------------------------------------


def test_the_engine_refuses_what_it_does_not_serve_with_images() -> None:
    image = [image_feature(2, 4, seed=0)]
    vl = frozenset({"image"})
    generate = EngineConfig(runner="generate")
    assert multimodal_refusal(generate, 8, image, vl, "VL") is None
    assert multimodal_refusal(generate, 8, [], frozenset(), "Text") is None
    refusal = multimodal_refusal(generate, 8, image, frozenset(), "LlamaForCausalLM")
    assert refusal is not None and "LlamaForCausalLM does not take image inputs" in refusal
    pooling = EngineConfig(runner="pooling")
    assert "--runner pooling" in (multimodal_refusal(pooling, 8, image, vl, "VL") or "")
    spec = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert "speculative decoding" in (multimodal_refusal(spec, 8, image, vl, "VL") or "")
    # placeholder ranges: inside the prompt, in order, not overlapping
    assert "not inside the prompt" in (multimodal_refusal(generate, 5, image, vl, "VL") or "")
    overlapping = [image_feature(2, 4, seed=0), image_feature(4, 2, seed=1)]
    assert "overlaps" in (multimodal_refusal(generate, 8, overlapping, vl, "VL") or "")


# -- the runner's side ----------------------------------------------------------------------


class StubVisionModel:
    """Just what :class:`MultiModalRunner` asks of a model: embeddings are the token id in
    every column, an image's rows ``1000 + 100 * (its first pixel > 0) + row``; M-RoPE as
    Qwen2-VL's for an image of 2 rows of ``length / 2`` merged patches."""

    supported_modalities = frozenset({"image"})
    uses_mrope = True
    hidden = 3

    def __init__(self) -> None:
        self.encoded: list[int] = []  # the length of each image encoded

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids.to(torch.float32)[:, None].repeat(1, self.hidden)

    def embed_multimodal(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        length = int(inputs["image_grid_thw"][0, 2]) // 2
        first = 100.0 * float(inputs["pixel_values"][0, 0] > 0)
        self.encoded.append(length)
        rows = 1000 + first + torch.arange(length, dtype=torch.float32)
        return rows[:, None].repeat(1, self.hidden)

    def mrope_positions(
        self, prompt_token_ids: Sequence[int], features: Sequence[MultiModalFeature]
    ) -> tuple[np.ndarray, int]:
        num_tokens = len(prompt_token_ids)
        table = np.zeros((3, num_tokens), dtype=np.int64)
        index = position = 0  # the next token, and the next text position
        for f in features:
            table[:, index : f.offset] = position + np.arange(f.offset - index)
            position += f.offset - index
            cols = f.length // 2
            table[0, f.offset : f.end] = position
            table[1, f.offset : f.end] = position + np.arange(f.length) // cols
            table[2, f.offset : f.end] = position + np.arange(f.length) % cols
            position += max(2, cols)
            index = f.end
        table[:, index:] = position + np.arange(num_tokens - index)
        return table, int(table.max()) + 1 - num_tokens


def run_step(
    mm: MultiModalRunner, scheduled: list[tuple[str, list[int], int, int]]
) -> tuple[np.ndarray, torch.Tensor | None]:
    """One step of ``(request id, its tokens, start, count)``: the rotary positions and the
    inputs_embeds, then the step's end."""
    counts = np.array([n for *_, n in scheduled], dtype=np.int64)
    starts = np.array([s for _, _, s, _ in scheduled], dtype=np.int64)
    qsl = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
    positions = np.concatenate([np.arange(s, s + n) for _, _, s, n in scheduled])
    ids = torch.tensor(
        [tokens[p] for (_, tokens, s, n) in scheduled for p in range(s, s + n)], dtype=torch.int64
    )
    request_ids = [r for r, *_ in scheduled]
    rotary = mm.rotary_positions(request_ids, qsl, positions)
    embeds = mm.inputs_embeds(request_ids, starts, counts, qsl, ids)
    mm.finish_step(request_ids, starts + counts)
    return rotary, embeds


def test_the_runner_encodes_each_image_once_and_splices_its_rows() -> None:
    model = StubVisionModel()
    mm = MultiModalRunner(model, torch.device("cpu"))  # type: ignore[arg-type]
    assert not mm
    prompt = image_prompt(before=3, length=4, after=2)  # image at 3..6, prompt of 9
    feature = image_feature(3, 4, seed=3)
    mm.add("text", [5, 6, 7], [])  # nothing kept for text
    assert not mm and "text" not in mm
    mm.add("a", prompt, [feature])
    assert mm and "a" in mm

    # chunk 1: positions 0..4 (the image's first two tokens) and the text request's decode
    rotary, embeds = run_step(mm, [("a", prompt, 0, 5), ("text", [5, 6, 7, 8], 3, 1)])
    assert model.encoded == [4] and mm.num_cached_outputs == 1
    assert rotary.shape == (3, 6)  # the image's w components differ
    assert rotary[:, :5].tolist() == [[0, 1, 2, 3, 3], [0, 1, 2, 3, 3], [0, 1, 2, 3, 4]]
    assert rotary[:, 5].tolist() == [3, 3, 3]  # text: the sequence position
    assert embeds is not None
    first = embeds[:, 0].tolist()
    assert first[:3] == [100.0, 101.0, 102.0] and first[5] == 8.0
    image_rows = first[3:5]
    assert image_rows[1] == image_rows[0] + 1 and image_rows[0] >= 1000

    # chunk 2: the image's last two tokens: its cached output, not a second encoder run
    rotary, embeds = run_step(mm, [("a", prompt, 5, 2)])
    assert model.encoded == [4]
    assert embeds is not None and embeds[:, 0].tolist() == [image_rows[0] + 2, image_rows[0] + 3]
    assert mm.num_cached_outputs == 0  # computed past the image's end: dropped

    # the rest of the prompt is text: no inputs_embeds; the rotary positions are shifted
    rotary, embeds = run_step(mm, [("a", prompt, 7, 2)])
    assert embeds is None and rotary.ndim == 1
    table, delta = model.mrope_positions(prompt, [feature])
    assert rotary.tolist() == table[0, 7:9].tolist()
    # a decode past the prompt: p + delta, one component
    rotary, embeds = run_step(mm, [("a", [*prompt, 50], 9, 1)])
    assert embeds is None and rotary.tolist() == [9 + delta]

    # preempted and back: encoded again when its image is scheduled again
    mm.remove("a")
    assert not mm
    mm.add("a", prompt, [feature])
    run_step(mm, [("a", prompt, 0, 9)])
    assert model.encoded == [4, 4] and mm.num_cached_outputs == 0


def test_a_prefix_hit_inside_the_image_uses_the_rows_after_it() -> None:
    model = StubVisionModel()
    mm = MultiModalRunner(model, torch.device("cpu"))  # type: ignore[arg-type]
    prompt = image_prompt(before=2, length=6, after=2)  # image at 2..7
    mm.add("a", prompt, [image_feature(2, 6, seed=3)])
    _, whole = run_step(mm, [("a", prompt, 0, 10)])
    mm.add("b", prompt, [image_feature(2, 6, seed=3)])
    _, after_hit = run_step(mm, [("b", prompt, 4, 6)])  # 4 tokens cached
    assert whole is not None and after_hit is not None
    assert torch.equal(after_hit, whole[4:])
    # a hit past the image: never encoded
    mm.add("c", prompt, [image_feature(2, 6, seed=3)])
    run_step(mm, [("c", prompt, 8, 2)])
    assert model.encoded == [6, 6]


def test_a_wrong_encoder_output_is_refused_by_name() -> None:
    model = StubVisionModel()
    mm = MultiModalRunner(model, torch.device("cpu"))  # type: ignore[arg-type]
    prompt = image_prompt(before=1, length=4, after=1)
    bad = msgspec.structs.replace(image_feature(1, 4, seed=0), length=3)
    mm.add("a", prompt, [bad])
    with pytest.raises(ValueError, match="embed_multimodal returned shape"):
        run_step(mm, [("a", prompt, 0, 6)])
    with pytest.raises(ValueError, match="has video input, which StubVisionModel does not take"):
        mm.add("v", prompt, [msgspec.structs.replace(bad, modality="video")])


def test_features_survive_the_tensor_parallel_hand_over() -> None:
    """Worker ranks decode the driver's SchedulerOutput with msgspec (core/tp_worker_proc.py):
    the features arrive whole."""
    feature = image_feature(3, 4, seed=0)
    new = NewRequestData(
        request_id="a",
        prompt_token_ids=image_prompt(3, 4, 2),
        output_token_ids=[],
        sampling_params=SamplingParams(),
        block_ids=[[0, 1, 2]],
        num_computed_tokens=0,
        mm_features=[feature],
    )
    plan = SchedulerOutput(new_requests=[new], num_scheduled_tokens={"a": 9})
    wire = msgspec.msgpack.Encoder().encode(plan)
    [decoded] = msgspec.msgpack.Decoder(SchedulerOutput).decode(wire).new_requests[0].mm_features
    assert decoded == feature
    for name, tensor in feature.tensors().items():
        assert torch.equal(decoded.tensors()[name], tensor)


# -- end to end: the tiny Qwen2-VL / Qwen2.5-VL checkpoints against HF ------------------------
#
# The tiny random models' greedy tokens hardly depend on the image (they repeat one token),
# so each answer is compared with HF's by its tokens *and* by the logprob of each chosen
# token (atol 1e-4, float32), which does depend on the image.

ARCHS = ["qwen2_vl", "qwen2_5_vl"]
IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_TOKEN_ID = 49154  # <|image_pad|> in the tiny checkpoints' tokenizer


def chat_prompt(text: str, num_images: int, before: str = "") -> str:
    images = IMAGE_PART * num_images
    return f"<|im_start|>user\n{before}{images}{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fixtures_qwen2_vl import save_tiny_qwen2_vl

    return {arch: save_tiny_qwen2_vl(tmp_path_factory.mktemp(arch), arch=arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def images() -> dict[str, Any]:
    from fixtures_qwen2_vl import random_image

    return {
        "square": random_image(112, 112, seed=1),  # 16 tokens; 4 windows in Qwen2.5-VL
        "wide": random_image(56, 112, seed=2),
        "tall": random_image(84, 56, seed=3),
        "other": random_image(112, 112, seed=4),
    }


def hf_answer(model_dir: Path, prompt: str, images: list[Any], model: Any = None) -> Answer:
    """HF ``generate``'s greedy answer (float32; EOS ignored) with each token's logprob;
    ``model``: the HF model to run (default: the checkpoint's)."""
    from fixtures_qwen2_vl import hf_inputs

    if model is None:
        model = hf_image_text_model(model_dir)
    return hf_generate(model.eval(), hf_inputs(model_dir, prompt, images))


class Generated(NamedTuple):
    answer: Answer
    num_cached_tokens: int
    prompt_token_ids: list[int]


def generate(llm: Any, cases: list[tuple[str, list[Any]]], **kwargs: Any) -> list[Generated]:
    """``llm.generate`` of every ``(prompt, images)`` in one call: greedy, EOS ignored,
    with each token's logprob."""
    outputs = llm.generate(media_prompts(cases), PARAMS, **kwargs)
    return [
        Generated(answer, cached, list(output.prompt_token_ids))
        for (answer, cached), output in zip(answers_and_cached(outputs), outputs, strict=True)
    ]


#: the small float32 engine (the name the Qwen-VL test modules import)
vl_llm = small_llm


@pytest.mark.parametrize("arch", ARCHS)
def test_images_match_hf_in_one_batch(vl_dirs, images, arch: str) -> None:
    """One image, two images, and a text prompt in one batch: HF's answer each."""
    model_dir = vl_dirs[arch]
    cases = {
        "one": (chat_prompt("Describe it.", 1), [images["square"]]),
        "two": (chat_prompt("Compare them.", 2), [images["wide"], images["tall"]]),
        "text": (chat_prompt("Tell me a story.", 0), []),
    }
    llm = vl_llm(model_dir)
    try:
        got = generate(llm, list(cases.values()))
    finally:
        llm.shutdown()
    for (name, (prompt, case_images)), result in zip(cases.items(), got, strict=True):
        result.answer.assert_matches(hf_answer(model_dir, prompt, case_images), name)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_prefix_cache_with_images(vl_dirs, images, arch: str) -> None:
    """Steps of 16 tokens cut through the 16-token image; the same image again hits the
    prefix cache through it (no encoder run), another image behind the same text hits only
    the text before it and answers otherwise. Every answer is HF's."""
    model_dir = vl_dirs[arch]
    prompt = chat_prompt("What is in this picture?", 1, before="Look here:")
    llm = vl_llm(model_dir, block_size=4, max_num_batched_tokens=16)
    runner = llm.engine.executor.worker.runner
    try:
        [cold] = generate(llm, [(prompt, [images["square"]])])
        assert runner.mm.num_encoder_runs == 1  # once, though its tokens took two steps
        [warm] = generate(llm, [(prompt, [images["square"]])])
        [changed] = generate(llm, [(prompt, [images["other"]])])
    finally:
        llm.shutdown()
    # the image's 16 placeholder tokens start inside a block and span five
    image_start = cold.prompt_token_ids.index(IMAGE_TOKEN_ID)
    assert image_start % 4 != 0 and cold.prompt_token_ids.count(IMAGE_TOKEN_ID) == 16
    expected = hf_answer(model_dir, prompt, [images["square"]])
    cold.answer.assert_matches(expected, "cold")
    warm.answer.assert_matches(expected, "warm")
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens >= image_start + 16  # hit through the whole image
    assert runner.mm.num_encoder_runs == 2  # "again" needed no encoder; "other" did
    assert runner.mm.num_cached_outputs == 0  # each dropped once its image was computed
    # the same tokens, another image: only the text blocks before the image are shared
    assert changed.num_cached_tokens == image_start // 4 * 4
    other_expected = hf_answer(model_dir, prompt, [images["other"]])
    changed.answer.assert_matches(other_expected, "other image")
    # (the image matters: these comparisons are not vacuous)
    assert np.abs(np.subtract(other_expected.logprobs, expected.logprobs)).max() > 10 * ATOL


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_tensor_parallel_ranks_with_images(vl_dirs, images) -> None:
    """Rank 1 gets the features over the wire and runs the tower itself: HF's answers."""
    from test_tensor_parallel import wait_for_no_workers

    model_dir = vl_dirs["qwen2_5_vl"]
    cases = {
        "one": (chat_prompt("Describe it.", 1), [images["square"]]),
        "two": (chat_prompt("Compare them.", 2), [images["tall"], images["wide"]]),
    }
    llm = vl_llm(model_dir, tensor_parallel_size=2, max_num_batched_tokens=16, block_size=4)
    try:
        got = generate(llm, list(cases.values()))
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    wait_for_no_workers()
    for (name, (prompt, case_images)), result in zip(cases.items(), got, strict=True):
        result.answer.assert_matches(hf_answer(model_dir, prompt, case_images), name)


def test_preempted_requests_bring_their_images_back(vl_dirs, images) -> None:
    """A KV cache too small for three image prompts at once: preempted requests come back
    with their images (encoded again when their tokens are) and still answer as HF."""
    model_dir = vl_dirs["qwen2_vl"]
    cases = [
        (chat_prompt("Describe it.", 1), [images["square"]]),
        (chat_prompt("Compare.", 1), [images["wide"]]),
        (chat_prompt("A story.", 1), [images["tall"]]),
    ]
    llm = vl_llm(
        model_dir, block_size=4, num_kv_blocks=12, max_model_len=48, max_num_batched_tokens=16
    )
    try:
        got = generate(llm, cases)
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    for i, ((prompt, case_images), result) in enumerate(zip(cases, got, strict=True)):
        result.answer.assert_matches(hf_answer(model_dir, prompt, case_images), f"case {i}")


def test_lora_adapters_with_images(vl_dirs, images, tmp_path: Path) -> None:
    """An adapter on the language model (never the tower) with an image: HF's answer with
    the adapter merged into its weights; the base model's beside it in the same batch."""
    import transformers as tf
    from safetensors.torch import save_file

    from chassis.core.lora.request import LoRARequest

    model_dir = vl_dirs["qwen2_vl"]
    hf = tf.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    # a PEFT adapter as trained on the checkpoint's language model (Qwen2's module names)
    generator = torch.Generator().manual_seed(0)
    rank, alpha = 8, 16
    tensors = {}
    for layer in range(2):
        for module in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
            linear = hf.get_submodule(f"model.language_model.layers.{layer}.{module}")
            a = torch.randn(rank, linear.in_features, generator=generator) * 0.2
            b = torch.randn(linear.out_features, rank, generator=generator) * 0.2
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            with torch.no_grad():
                linear.weight += alpha / rank * (b @ a)
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha}
    adapter_config["target_modules"] = ["q_proj", "v_proj", "down_proj"]
    # the same adapter as trained on transformers 5's layout (model.language_model.layers.*)
    hub, transformers5 = tmp_path / "hub", tmp_path / "transformers5"
    for folder, names in (
        (hub, tensors),
        (transformers5, {k.replace(".model.layers.", ".model.language_model.layers."): v
                         for k, v in tensors.items()}),
    ):  # fmt: skip
        folder.mkdir()
        save_file(names, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(adapter_config))

    prompt, case_images = chat_prompt("Describe it.", 1), [images["square"]]
    llm = vl_llm(model_dir, enable_lora=True, max_lora_rank=rank)
    try:
        lora = LoRARequest("adapter", 1, str(hub))
        lora5 = LoRARequest("adapter5", 2, str(transformers5))
        base, adapted, adapted5 = generate(
            llm, [(prompt, case_images)] * 3, lora_request=[None, lora, lora5]
        )
    finally:
        llm.shutdown()
    base.answer.assert_matches(hf_answer(model_dir, prompt, case_images), "base")
    merged = hf_answer(model_dir, prompt, case_images, model=hf)
    adapted.answer.assert_matches(merged, "adapter")
    adapted5.answer.assert_matches(merged, "adapter with transformers 5's names")
    assert adapted.answer.tokens != base.answer.tokens


def test_speculative_engines_refuse_images_and_serve_text(vl_dirs) -> None:
    """The engine core refuses a request with images under speculative decoding (the
    request's fault, named), and goes on serving text."""
    from fixtures_qwen2_vl import random_image

    from chassis.core.request import EngineCoreRequest, FinishReason

    speculative = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    llm = vl_llm(vl_dirs["qwen2_vl"], speculative_config=speculative)
    try:
        request = EngineCoreRequest(
            request_id="image",
            prompt_token_ids=image_prompt(3, 4, 2),
            sampling_params=SamplingParams(max_tokens=2),
            mm_features=[image_feature(3, 4, seed=0)],
        )
        llm.engine.add_request(request)
        [refused] = llm.engine.step().outputs
        assert refused.finish_reason == FinishReason.ABORT and refused.error is not None
        assert refused.error.client_error
        assert "not supported with speculative decoding" in refused.error.message
        # the front-end refuses first (before any image is processed): LLM.generate raises
        prompt = "<|vision_start|><|image_pad|><|vision_end|>What is this?"
        with pytest.raises(ValueError, match="not supported with speculative decoding"):
            llm.generate({"prompt": prompt, "multi_modal_data": {"image": random_image(56, 56)}})
        [text] = generate(llm, [(chat_prompt("Tell me a story.", 0), [])])
        assert len(text.answer.tokens) == NUM_TOKENS
    finally:
        llm.shutdown()


class RecordingGraphs:
    """Stands in for captured decode graphs (none on the CPU): records the positions each
    "replay" gets and runs the model eager with them, as a replay would."""

    #: as DecodeGraphs without a logits_fn: the runner computes the logits eager
    last_logits = None

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.positions: list[list[int]] = []

    def size_for(self, num_tokens: int) -> int:
        return num_tokens

    def run(self, input_ids, positions, slot_mapping, seq_lens, block_table) -> torch.Tensor:
        from chassis.core.model_runner import step_forward_context

        self.positions.append(positions.tolist())
        runner = self.runner
        query_start_loc = np.arange(len(seq_lens) + 1, dtype=np.int32)
        ctx = step_forward_context(
            query_start_loc,
            seq_lens,
            block_table,
            slot_mapping,
            1,
            runner._to_device,
            runner.kv_caches,
            runner.layer_group,
        )
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.from_numpy(input_ids)
        return runner.model(ids, torch.from_numpy(positions), ctx)


def test_decode_graphs_replay_with_the_shifted_rotary_positions(vl_dirs, images) -> None:
    """Decode steps of a request with an image replay graphs with its rotary positions,
    ``p + delta`` (the slots still come from ``p``), and answer as HF."""
    model_dir = vl_dirs["qwen2_5_vl"]
    prompt, case_images = chat_prompt("Describe it.", 1), [images["square"]]
    llm = vl_llm(model_dir)
    try:
        runner = llm.engine.executor.worker.runner
        graphs = runner.graphs = RecordingGraphs(runner)
        [result] = generate(llm, [(prompt, case_images)])
    finally:
        llm.shutdown()
    result.answer.assert_matches(hf_answer(model_dir, prompt, case_images), "replayed")
    num_prompt = len(result.prompt_token_ids)
    delta = -12  # a 4x4 grid of merged patches: 16 tokens, 4 rotary positions
    expected = [[p + delta] for p in range(num_prompt, num_prompt + NUM_TOKENS - 1)]
    assert graphs.positions == expected
