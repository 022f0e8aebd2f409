"""Whisper (``WhisperForConditionalGeneration``) against HF transformers on a tiny random float32
checkpoint (tests/fixtures_whisper.py: 2 + 2 layers, d_model 32, 80 mel bins, 30 s windows).

Checked: the features against HF's ``WhisperFeatureExtractor``; greedy tokens through
``LLM.generate`` (decoder prompt + one clip) against HF ``generate`` over the same features and
forced decoder prompt, and each token's logprob against HF's logits (1e-4); several clips of
different lengths in one batch; chunked prefill (2-token steps, which the encoder's first
step precedes); more requests than state slots, with preemptions; the refusals; prefix
caching turned off with one info line.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_whisper import (
    PROMPT,
    SAMPLING_RATE,
    hf_features,
    hf_greedy,
    hf_model,
    prompt_ids,
    random_clip,
    save_tiny_whisper,
)

from chassis import LLM, SamplingParams

NUM_TOKENS = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
ENGINE: dict[str, Any] = {"dtype": "float32", "max_model_len": 64, "num_kv_blocks": 64}
DECODER_IDS = prompt_ids("<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")
#: (seed, seconds) of the test clips
CLIPS = ((1, 3.0), (2, 1.0), (3, 12.5), (4, 30.0))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_whisper(tmp_path_factory.mktemp("whisper"))


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    return [random_clip(seconds, seed) for seed, seconds in CLIPS]


@pytest.fixture(scope="module")
def expected(model_dir: Path, clips: list[np.ndarray]) -> list[tuple[list[int], list[float]]]:
    """HF's greedy tokens per clip and the logprob of each (from HF's logits)."""
    hf = hf_model(model_dir)
    result = []
    for clip in clips:
        features = hf_features(model_dir, clip)
        tokens = hf_greedy(hf, features, DECODER_IDS, NUM_TOKENS)
        with torch.no_grad():
            logits = hf(
                input_features=features,
                decoder_input_ids=torch.tensor([DECODER_IDS + tokens[:-1]]),
            ).logits[0, len(DECODER_IDS) - 1 :]
        logprobs = torch.log_softmax(logits.double(), -1)
        result.append((tokens, [float(logprobs[i, t]) for i, t in enumerate(tokens)]))
    assert len({tuple(tokens) for tokens, _ in result}) > 1, "clips should change the answer"
    return result


def requests(clips: list[np.ndarray], prompt: str = PROMPT) -> list[dict[str, Any]]:
    return [{"prompt": prompt, "multi_modal_data": {"audio": (c, SAMPLING_RATE)}} for c in clips]


def check(outputs: list[Any], expected: list[tuple[list[int], list[float]]], what: str) -> None:
    for i, (out, (tokens, logprobs)) in enumerate(zip(outputs, expected, strict=True)):
        completion = out.outputs[0]
        assert list(completion.token_ids) == tokens, f"{what}: clip {i}"
        got = [lp[t].logprob for lp, t in zip(completion.logprobs, tokens, strict=True)]
        np.testing.assert_allclose(got, logprobs, atol=1e-4, err_msg=f"{what}: clip {i}")


def test_features_match_the_hf_extractor(model_dir: Path, clips: list[np.ndarray]) -> None:
    from chassis.builtin_plugins.models.whisper_processing import WhisperInputs
    from chassis.core.model_loader import load_hf_config

    processor = WhisperInputs.from_pretrained(model_dir, load_hf_config(str(model_dir)))
    ids, [feature] = processor.process(DECODER_IDS, {"audio": [(clips[0], SAMPLING_RATE)]})
    assert ids == DECODER_IDS and (feature.offset, feature.length) == (0, 1)
    torch.testing.assert_close(
        feature.tensors()["input_features"], hf_features(model_dir, clips[0]), atol=0, rtol=0
    )


def test_generate_matches_hf(
    model_dir: Path, clips: list[np.ndarray], expected: list[tuple[list[int], list[float]]]
) -> None:
    llm = LLM(str(model_dir), **ENGINE)
    try:
        check(llm.generate(requests(clips), PARAMS), expected, "one batch")
        check(llm.generate(requests(clips[1:2]), PARAMS), expected[1:2], "alone")
        # a text prompt is tokenized without special tokens (vLLM's rule for encoder-
        # decoders), although the hub-style tokenizer would add its prefix and end of text
        tokenizer = llm.get_tokenizer()
        assert tokenizer(PROMPT).input_ids != DECODER_IDS
        [out] = llm.generate(requests(clips[:1]), PARAMS)
        assert list(out.prompt_token_ids) == DECODER_IDS
        by_ids = [
            {"prompt_token_ids": DECODER_IDS, "multi_modal_data": r["multi_modal_data"]}
            for r in requests(clips[:1])
        ]
        check(llm.generate(by_ids, PARAMS), expected[:1], "token ids")
        # a request without its clip is refused (its encoder would read nothing)
        for request in (
            PROMPT,
            {"prompt_token_ids": DECODER_IDS},
            {"prompt": PROMPT, "multi_modal_data": {}},
            {"prompt": PROMPT, "multi_modal_data": {"audio": []}},
        ):
            with pytest.raises(ValueError, match="needs its audio clip"):
                llm.generate(request, PARAMS)
        # no chat template (as the hub's checkpoints): chat is refused, saying so
        with pytest.raises(ValueError, match="chat template"):
            llm.chat([{"role": "user", "content": "hi"}], PARAMS)
        with pytest.raises(ValueError, match="exactly one audio clip"):
            llm.generate({"prompt": PROMPT, "multi_modal_data": {"audio": [clips[0]] * 2}})
        with pytest.raises(ValueError, match="longer than Whisper's 30 s window"):
            llm.generate(requests([random_clip(30.5)]))
    finally:
        llm.shutdown()


def test_chunked_prefill_more_requests_than_slots_and_preemption(
    model_dir: Path,
    clips: list[np.ndarray],
    expected: list[tuple[list[int], list[float]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 3-token steps: a 4-token decoder prompt takes two, the encoder runs in the first;
    # 3 state slots for 8 requests, and 4 KV blocks of 4 tokens where each request ends
    # holding 3: requests wait for slots and some are preempted (recomputed from position
    # 0, the encoder again: more encoder runs than requests)
    from chassis.core.multimodal_runner import MultiModalRunner

    encoder_runs: list[int] = []
    original = MultiModalRunner.encoder_inputs

    def counted(self: MultiModalRunner, *args: Any) -> Any:
        inputs = original(self, *args)
        encoder_runs.extend(1 for item in inputs or () if item is not None)
        return inputs

    monkeypatch.setattr(MultiModalRunner, "encoder_inputs", counted)
    max_len = len(DECODER_IDS) + NUM_TOKENS
    llm = LLM(
        str(model_dir),
        **{
            **ENGINE,
            "block_size": 4,
            "max_num_batched_tokens": 3,
            "max_num_seqs": 3,
            "max_model_len": max_len,
            "num_kv_blocks": math.ceil(max_len / 4) + 1,
        },
    )
    try:
        outputs = llm.generate(requests(clips + clips), PARAMS)
        check(outputs, expected + expected, "chunked, 3 slots, preempted")
    finally:
        llm.shutdown()
    assert len(encoder_runs) > 2 * len(clips)


def test_prefix_caching_is_turned_off_with_one_info_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from chassis.builtin_plugins.models.whisper import WhisperForConditionalGeneration
    from chassis.core.config import EngineConfig
    from chassis.core.request_state_cache import apply_recurrent_state_settings

    config = EngineConfig(model="whisper", enable_prefix_caching=True)
    with caplog.at_level("INFO", logger="chassis.core.request_state_cache"):
        apply_recurrent_state_settings(config, WhisperForConditionalGeneration)
    assert not config.enable_prefix_caching
    [line] = [r.getMessage() for r in caplog.records]
    assert "cross-attention keys and values of its audio" in line
    assert "prefix caching is off" in line


def test_state_messages_name_the_cross_kv_and_only_max_num_seqs() -> None:
    from chassis.builtin_plugins.models.whisper import WhisperForConditionalGeneration
    from chassis.core.config import EngineConfig
    from chassis.core.request_state_cache import (
        RequestStatePool,
        RequestStateSpec,
        apply_recurrent_state_settings,
        state_pool_over_budget,
    )

    config = EngineConfig(model="whisper", speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="cross-attention keys and values of its audio"):
        apply_recurrent_state_settings(config, WhisperForConditionalGeneration)
    # Whisper's specs have no kind: the dtype flags would not shrink its pool
    specs = [
        RequestStateSpec(f"layers.{i}.cross_kv", (2, 4, 1500, 8), torch.float32) for i in (0, 1)
    ]
    message = state_pool_over_budget(RequestStatePool(specs, 2, "cpu"), -1, profiled=True)
    assert "lower --max-num-seqs" in message and "mamba" not in message
