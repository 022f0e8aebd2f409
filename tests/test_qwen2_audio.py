"""Qwen2-Audio (``Qwen2AudioForConditionalGeneration``) with audio against HF transformers on
a tiny random checkpoint (tests/fixtures_qwen2_audio.py: Qwen2 text, 2 layers of hidden 64;
an audio tower of 2 layers, d_model 32, 128 mel bins, 30 s clips).

Checked, float32: the tower and projector rows against HF's (its audio tower with the
attention mask its forward builds, then its projector) to 1e-5; the expanded prompt and the
features against ``Qwen2AudioProcessor``'s; prefill and decode logits with one and two clips
against HF's forward to 1e-4; greedy tokens and each token's logprob through
``LLM.generate`` against HF ``generate`` (one clip, two clips, text, in one batch, in
chunks cutting through the clips; two tensor-parallel ranks); ``LLM.chat`` and the server's
chat route with an ``input_audio`` wav part and an ``audio_url`` data URL; resampling of a
44.1 kHz clip; wav and mp3 decoding from each kind of source; both weight layouts; a
bfloat16 tower; and the refusals.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_qwen2_audio import (
    AUDIO_TOKEN_ID,
    SAMPLING_RATE,
    hf_inputs,
    hf_model,
    random_clip,
    save_tiny_qwen2_audio,
    wav_bytes,
)
from mm_hf_compare import (
    CHUNKED,
    Answer,
    answers,
    assert_prefill_and_decode_match,
    checkpoint_fixtures,
    hf_generate,
    prefill_then_decode,
    small_llm,
    two_rank_answers,
)
from safetensors.torch import load_file
from test_models_parity import Runner

from chassis import SamplingParams
from chassis.builtin_plugins.models.qwen2_audio_encoder import audio_token_count
from chassis.core.audio_resampling import resample
from chassis.core.multimodal import MultiModalFeature, make_feature

PLACEHOLDER = "<|audio_bos|><|AUDIO|><|audio_eos|>"
ONE = f"<|im_start|>user\nAudio 1: {PLACEHOLDER}\nWhat is that sound?<|im_end|>\n"
TWO = f"<|im_start|>user\nFirst {PLACEHOLDER} then {PLACEHOLDER} compare.<|im_end|>\n"
TEXT = "<|im_start|>user\nTell me a story.<|im_end|>\n"
NUM_TOKENS = 5


model_dir, hf, runner = checkpoint_fixtures(save_tiny_qwen2_audio, hf_model)


@pytest.fixture(scope="module")
def clips() -> dict[str, np.ndarray]:
    # 1.3 s: 130 frames, 32 rows; 0.7 s: 70 frames, 17 rows; 2 s: 200 frames, 50 rows
    return {
        "a": random_clip(1.3, seed=1),
        "b": random_clip(0.7, seed=2),
        "c": random_clip(2.0, seed=3),
    }


def features_of(inputs: dict[str, torch.Tensor]) -> list[MultiModalFeature]:
    """One feature per clip of HF's ``inputs``, as the front-end makes them."""
    ids = inputs["input_ids"][0].tolist()
    runs: list[list[int]] = []
    for i, t in enumerate(ids):
        if t == AUDIO_TOKEN_ID:
            if i and ids[i - 1] == t:
                runs[-1][1] += 1
            else:
                runs.append([i, 1])
    masks = inputs.get("feature_attention_mask", torch.zeros(0, 0))
    assert len(runs) == len(masks)
    return [
        make_feature(
            "audio",
            start,
            length,
            {
                "input_features": features[None],
                "num_frames": mask.sum().reshape(1).to(torch.int64),
            },
        )
        for (start, length), features, mask in zip(
            runs, inputs["input_features"], masks, strict=True
        )
    ]


# -- the audio side ---------------------------------------------------------------------------


def hf_audio_rows(hf: Any, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """HF's rows of each clip: its tower under the mask its forward builds, projected, cut to
    the clip's length (what its forward scatters into the prompt)."""
    from transformers.masking_utils import create_bidirectional_mask

    model = hf.model
    lengths = inputs["feature_attention_mask"].sum(-1)
    conv_lengths, out_lengths = model.audio_tower._get_feat_extract_output_lengths(lengths)
    positions = torch.arange((inputs["input_features"].shape[-1] - 2) // 2 + 1)
    mask_2d = (positions[None, :] < conv_lengths[:, None]).long()
    dummy = torch.zeros(len(lengths), len(positions), 1)
    mask = create_bidirectional_mask(
        config=model.audio_tower.config, inputs_embeds=dummy, attention_mask=mask_2d
    )
    with torch.no_grad():
        states = model.audio_tower(inputs["input_features"], attention_mask=mask).last_hidden_state
        rows = model.multi_modal_projector(states)
    return [r[:n] for r, n in zip(rows, out_lengths.tolist(), strict=True)]


def test_tower_and_projector_match_hf(
    model_dir: Path, hf: Any, runner: Runner, clips: dict[str, np.ndarray]
) -> None:
    inputs = hf_inputs(model_dir, TWO, [clips["a"], clips["c"]])
    expected = hf_audio_rows(hf, inputs)
    features = features_of(inputs)
    with torch.no_grad():
        for feature, rows in zip(features, expected, strict=True):
            ours = runner.model.embed_multimodal("audio", feature.tensors())
            assert ours.shape == rows.shape == (feature.length, 64)
            torch.testing.assert_close(ours, rows, atol=1e-5, rtol=1e-5)


def test_the_tower_runs_in_the_model_dtype(
    model_dir: Path, runner: Runner, clips: dict[str, np.ndarray]
) -> None:
    """A bfloat16 model's rows are bfloat16 and close to the float32 ones."""
    [feature] = features_of(hf_inputs(model_dir, ONE, [clips["a"]]))
    with torch.no_grad():
        rows = Runner(model_dir, torch.bfloat16).model.embed_multimodal("audio", feature.tensors())
        expected = runner.model.embed_multimodal("audio", feature.tensors())
    assert rows.dtype == torch.bfloat16 and rows.shape == expected.shape
    torch.testing.assert_close(rows.float(), expected, atol=0.1, rtol=0.05)


def test_prompts_expand_as_qwen2_audio_processor(
    model_dir: Path, clips: dict[str, np.ndarray]
) -> None:
    from chassis.builtin_plugins.models.qwen2_audio import (
        Qwen2AudioForConditionalGenerationWithAudio,
    )
    from chassis.core.model_loader import language_model_config, load_hf_config
    from chassis.core.tokenizer import load_tokenizer

    config = language_model_config(load_hf_config(model_dir))
    processor = Qwen2AudioForConditionalGenerationWithAudio.multimodal_processor(
        str(model_dir), config
    )
    tokenizer = load_tokenizer(model_dir)
    for prompt, pieces in ((ONE, [clips["b"]]), (TWO, [clips["a"], clips["c"]])):
        inputs = hf_inputs(model_dir, prompt, pieces)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        expanded, features = processor.process(ids, {"audio": pieces})
        assert expanded == inputs["input_ids"][0].tolist()
        expected = features_of(inputs)
        assert [(f.offset, f.length) for f in features] == [(f.offset, f.length) for f in expected]
        for ours, theirs in zip(features, expected, strict=True):
            assert ours.identifier == theirs.identifier  # same tensors, bit for bit
    assert [audio_token_count(n) for n in (130, 70, 200, 3000)] == [32, 17, 50, 750]


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_clips", [1, 2])
def test_logits_with_audio_match_transformers(
    model_dir: Path, hf: Any, runner: Runner, clips: dict[str, np.ndarray], num_clips: int
) -> None:
    prompt, pieces = (ONE, [clips["a"]]) if num_clips == 1 else (TWO, [clips["b"], clips["c"]])
    inputs = hf_inputs(model_dir, prompt, pieces)
    prefill = assert_prefill_and_decode_match(runner, hf, inputs, features_of(inputs))
    if num_clips == 1:  # another clip of the same length: other logits after it
        other = hf_inputs(model_dir, prompt, [random_clip(1.3, seed=9)])
        ids = other["input_ids"][0].tolist()
        changed, _, _ = prefill_then_decode(runner, ids, features_of(other))
        end = features_of(inputs)[0].end
        assert (changed[end:] - prefill[end:]).abs().max() > 1e-3


# -- end to end through LLM -------------------------------------------------------------------


def hf_answer(hf: Any, model_dir: Path, prompt: str, pieces: list[np.ndarray]) -> Answer:
    """HF ``generate``'s greedy answer (``NUM_TOKENS``) with each token's logprob."""
    return hf_generate(hf, hf_inputs(model_dir, prompt, pieces), NUM_TOKENS)


#: this file's answers are shorter than mm_hf_compare's
PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Any:
    """One engine for the offline tests: steps of 16 tokens (chunked prefill through every
    clip: 17 to 50 rows), 4-token blocks, at most 2 clips a prompt."""
    engine = small_llm(model_dir, **CHUNKED, limit_mm_per_prompt={"audio": 2})
    yield engine
    engine.shutdown()


def test_generate_matches_hf(
    llm: Any, model_dir: Path, hf: Any, clips: dict[str, np.ndarray]
) -> None:
    """One clip (a ``(waveform, rate)`` tuple), two clips (a list: a bare array, and a tuple
    whose rate is a numpy integer) and text in one batch, in
    steps of 16 tokens that cut through the clips; then the first prompt alone. Every answer
    is HF's; each clip is encoded once however many steps its rows take; a third clip is
    over ``--limit-mm-per-prompt``."""
    cases = {
        "one": (ONE, [clips["a"]], (clips["a"], SAMPLING_RATE)),
        "two": (TWO, [clips["b"], clips["c"]], [clips["b"], (clips["c"], np.int64(16000))]),
        "text": (TEXT, [], None),
    }
    prompts = [
        {"prompt": p, "multi_modal_data": {"audio": data}} if data is not None else p
        for p, _, data in cases.values()
    ]
    runner = llm.engine.executor.worker.runner
    runs = runner.mm.num_encoder_runs
    batch = answers(llm.generate(prompts, PARAMS))
    assert runner.mm.num_encoder_runs == runs + 3
    [alone] = answers(llm.generate([prompts[0]], PARAMS))
    for (what, (prompt, pieces, _)), answer in zip(cases.items(), batch, strict=True):
        answer.assert_matches(hf_answer(hf, model_dir, prompt, pieces), what)
    alone.assert_matches(batch[0], "alone")
    with pytest.raises(ValueError, match="At most 2 audio"):
        llm.generate({"prompt": TWO + ONE, "multi_modal_data": {"audio": [clips["b"]] * 3}})


def chat_messages(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is that sound?"}]}]


def input_audio(wav: bytes) -> dict[str, Any]:
    data = base64.b64encode(wav).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def audio_url(wav: bytes) -> dict[str, Any]:
    return {
        "type": "audio_url",
        "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(wav).decode()},
    }


def test_chat_and_server_take_audio_parts(
    llm: Any, model_dir: Path, hf: Any, clips: dict[str, np.ndarray]
) -> None:
    """``LLM.chat`` with an ``input_audio`` wav (stereo: averaged to mono) and the server's
    chat route with the same part and an ``audio_url`` data URL give HF's answer for the
    prompt Qwen2-Audio's template writes; too many clips, bad bytes and a bad format are
    400s naming the part."""
    from fastapi.testclient import TestClient

    from chassis.core.async_llm import AsyncLLM
    from chassis.core.config import EngineConfig
    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    # the clip as the wav holds it (16-bit samples), HF's input
    wav = wav_bytes(clips["b"], channels=2)
    pcm = np.round(np.clip(clips["b"], -1, 1) * 32767).astype(np.int16) / 32768
    prompt = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        f"Audio 1: {PLACEHOLDER}\nWhat is that sound?<|im_end|>\n<|im_start|>assistant\n"
    )
    expected = hf_answer(hf, model_dir, prompt, [pcm.astype(np.float32)])

    [chatted] = answers(llm.chat(chat_messages(input_audio(wav)), PARAMS))
    chatted.assert_matches(expected, "LLM.chat")
    config = {
        "dtype": "float32",
        "max_model_len": 256,
        "num_kv_blocks": 64,
        "limit_mm_per_prompt": {"audio": 1},
    }

    engine = AsyncLLM.from_engine_config(EngineConfig(model=str(model_dir), **config))

    def chat(*parts: dict[str, Any]) -> Any:
        body = {
            "messages": chat_messages(*parts),
            "max_tokens": NUM_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        return client.post("/v1/chat/completions", json=body)

    try:
        settings = ServerSettings(shutdown_engine_on_exit=False)
        with TestClient(build_app(engine, settings)) as client:
            for part in (input_audio(wav), audio_url(wav)):
                answer = chat(part)
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["token_ids"] == expected.tokens
            bad_format = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}}
            for parts, match in (
                ([input_audio(wav)] * 2, "At most 1 audio"),
                ([input_audio(b"junk")], "not an audio file"),
                ([bad_format], "format must be one of wav, mp3"),
            ):
                refused = chat(*parts)
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert match in error["message"] and error["param"] == "messages.0.content"
            beam = client.post(
                "/v1/chat/completions",
                json={"messages": chat_messages(input_audio(wav)), "use_beam_search": True, "n": 2},
            )
            assert beam.status_code == 400, beam.text
            assert "beam search does not take audio inputs" in beam.json()["error"]["message"]
            # /tokenize takes no audio: a 400 naming the routes that do
            refused = client.post("/tokenize", json={"messages": chat_messages(input_audio(wav))})
            assert refused.status_code == 400, refused.text
            routes = "/v1/chat/completions, /v1/responses and LLM.chat"
            assert f"taken by {routes} only" in refused.text
    finally:
        engine.shutdown_sync()


# -- resampling -------------------------------------------------------------------------------


def test_resampling_44k_matches_a_reference_resampler(
    model_dir: Path, clips: dict[str, np.ndarray]
) -> None:
    """A 44.1 kHz clip of tones (440 Hz and 3 kHz) resampled to 16 kHz: within 1e-3 of scipy's
    polyphase resampler and of the tones sampled at 16 kHz (away from the ends); its
    features within 0.02 of HF's processor fed scipy's 16 kHz clip, with the same row count;
    equal rates pass through untouched."""
    signal = pytest.importorskip("scipy.signal")
    rate = 44100
    t = np.arange(int(1.2 * rate)) / rate
    tones = lambda t: 0.4 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 3000 * t)  # noqa: E731
    clip = tones(t).astype(np.float32)
    ours = resample(clip, rate, SAMPLING_RATE)
    theirs = signal.resample_poly(clip, 160, 441).astype(np.float32)
    assert len(ours) == len(theirs) == 19200
    inner = slice(100, -100)
    np.testing.assert_allclose(ours[inner], theirs[inner], atol=1e-3)
    exact = tones(np.arange(len(ours)) / SAMPLING_RATE)
    np.testing.assert_allclose(ours[inner], exact[inner], atol=1e-3)
    assert resample(clips["a"], SAMPLING_RATE, SAMPLING_RATE) is clips["a"]

    from chassis.builtin_plugins.models.qwen2_audio_processing import Qwen2AudioInputs
    from chassis.core.model_loader import language_model_config, load_hf_config

    processor = Qwen2AudioInputs.from_pretrained(
        model_dir, language_model_config(load_hf_config(model_dir))
    )
    length, tensors = processor.process_item("audio", (clip, rate), {})
    inputs = hf_inputs(model_dir, ONE, [theirs])
    [expected] = features_of(inputs)
    assert length == expected.length == audio_token_count(120)
    torch.testing.assert_close(
        tensors["input_features"], inputs["input_features"], atol=0.02, rtol=0
    )
    assert int(tensors["num_frames"]) == int(inputs["feature_attention_mask"].sum())
    # as torch tensors and integer sample arrays too
    assert processor.process_item("audio", (torch.from_numpy(clip), rate), {})[0] == length


# -- weights, classes and refusals ------------------------------------------------------------


def test_both_layouts_load_the_same_model(model_dir: Path, runner: Runner, tmp_path: Path) -> None:
    """transformers 5's saved names (``model.audio_tower.*``, ``model.language_model.*``)
    fill the same parameters as the hub's, the LM head untied even when the config asks for
    tied embeddings (as HF's class); every parameter is read."""
    from chassis.builtin_plugins.models.qwen2_audio import (
        Qwen2AudioForConditionalGenerationWithAudio,
    )

    saved = save_tiny_qwen2_audio(tmp_path, layout="saved")
    # a config asking for tied embeddings: HF's class ties none, nor does ours
    config = json.loads((saved / "config.json").read_text())
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True
    (saved / "config.json").write_text(json.dumps(config))
    names = load_file(saved / "model.safetensors")
    assert any(n.startswith("model.audio_tower.") for n in names)
    ours = dict(Runner(saved).model.named_parameters())
    hub = dict(runner.model.named_parameters())
    assert ours.keys() == hub.keys()
    for name, param in hub.items():
        torch.testing.assert_close(ours[name], param, atol=0, rtol=0, msg=name)
    model = runner.model
    assert isinstance(model, Qwen2AudioForConditionalGenerationWithAudio)
    assert type(model).__name__ == (
        "Qwen2AudioForConditionalGenerationWithAudioOverQwen2ForCausalLM"
    )
    assert model.supported_modalities == frozenset({"audio"})
    assert model.lora_slices("audio_tower.layers.0.fc1", model.audio_tower.layers[0].fc1) == []


def test_refusals(llm: Any, model_dir: Path, runner: Runner, tmp_path: Path) -> None:
    """Audio to a text-only model names it; images to Qwen2-Audio; beam search, speculative
    decoding and pooling engines with audio; bad clips and prompts."""
    from types import SimpleNamespace

    from fixtures_models import write_tiny_checkpoint

    from chassis import LLM
    from chassis.builtin_plugins.models.qwen2_audio_processing import Qwen2AudioInputs
    from chassis.core.model_loader import language_model_config, load_hf_config
    from chassis.core.multimodal_admission import engine_mode_refusal

    clip = random_clip(0.5)
    text_dir = write_tiny_checkpoint("qwen2", tmp_path / "text")
    text_llm = LLM(str(text_dir), dtype="float32", max_model_len=128, num_kv_blocks=16)
    try:
        with pytest.raises(ValueError, match=r"Qwen2ForCausalLM\) takes text only"):
            text_llm.generate({"prompt": "hi", "multi_modal_data": {"audio": clip}})
    finally:
        text_llm.shutdown()
    with pytest.raises(ValueError, match="takes audio inputs, not image"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": [np.zeros((4, 4, 3))]}})
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.beam_search([{"prompt": ONE, "multi_modal_data": {"audio": clip}}], _beam_params())
    with pytest.raises(ValueError, match="1 audio placeholder"):
        llm.generate({"prompt": ONE, "multi_modal_data": {"audio": [clip, clip]}})
    pooling = SimpleNamespace(runner="pooling", speculative_config=None)
    assert "not supported with --runner pooling" in engine_mode_refusal(pooling, ["audio"])
    spec = SimpleNamespace(runner="generate", speculative_config=object())
    assert "speculative decoding" in engine_mode_refusal(spec, ["audio"])

    processor = Qwen2AudioInputs.from_pretrained(
        model_dir, language_model_config(load_hf_config(model_dir))
    )
    for item, match in (
        (np.zeros((2, 800), np.float32), "must be 1-D"),
        (np.zeros(0, np.float32), "is empty"),
        (np.zeros(100, np.float32), "too short"),
        ((clip, 0), "sample rate must be a number of Hz > 0"),
        ((clip, 44100.5), "whole number"),
        (np.array([np.nan] * 800, np.float32), "NaN"),
        ("clip.wav", "must be a \\(waveform, sample_rate\\) tuple"),
    ):
        with pytest.raises(ValueError, match=match):
            processor.process([AUDIO_TOKEN_ID], {"audio": [item]})
    model = runner.model
    with pytest.raises(ValueError, match="takes audio, not 'image'"):
        model.embed_multimodal("image", {})
    with pytest.raises(ValueError, match="need input_features and num_frames"):
        model.embed_multimodal("audio", {"input_features": torch.zeros(1, 128, 3000)})
    with pytest.raises(ValueError, match=r"\[clips, 128, 3000\]"):
        model.embed_multimodal(
            "audio",
            {"input_features": torch.zeros(1, 128, 100), "num_frames": torch.tensor([50])},
        )
    (tmp_path / "no_extractor").mkdir()
    with pytest.raises(ValueError, match=r"no preprocessor_config\.json"):
        Qwen2AudioInputs.from_pretrained(
            tmp_path / "no_extractor", language_model_config(load_hf_config(model_dir))
        )


def _beam_params() -> Any:
    from chassis.core.beam_search import BeamSearchParams

    return BeamSearchParams(beam_width=2, max_tokens=2)


def test_audio_loader_decodes_wav_and_mp3_from_every_source(tmp_path: Path) -> None:
    """A wav's 16-bit samples come back exactly (channels averaged), at the file's rate; an
    mp3 (lossy) close to its clip; file:// URLs only under the allowed folder; data URLs of
    another media type, bad base64 and bytes without audio are refused naming the source."""
    from fixtures_qwen2_audio import mp3_bytes

    from chassis.core.audio_loading import AudioLoader

    clip = random_clip(0.5, seed=4, rate=22050)
    pcm = np.round(np.clip(clip, -1, 1) * 32767).astype(np.int16) / 32768
    loader = AudioLoader(tmp_path)
    wav = wav_bytes(clip, rate=22050, channels=2)
    waveform, rate = loader.load_input_audio(base64.b64encode(wav).decode(), "wav")
    assert rate == 22050 and waveform.dtype == np.float32
    np.testing.assert_array_equal(waveform, pcm.astype(np.float32))
    (tmp_path / "clip.wav").write_bytes(wav)
    from_file, _ = loader.load_url((tmp_path / "clip.wav").as_uri())
    np.testing.assert_array_equal(from_file, waveform)
    from_url, _ = loader.load_url(audio_url(wav)["audio_url"]["url"])
    np.testing.assert_array_equal(from_url, waveform)

    mono = random_clip(1.0, seed=5)
    decoded, rate = loader.load_input_audio(base64.b64encode(mp3_bytes(mono)).decode(), "mp3")
    assert rate == SAMPLING_RATE and abs(len(decoded) - len(mono)) <= 2 * 1152
    # (the encoder's delay shifts the samples: compare by correlation at the best lag)
    lag = int(np.argmax(np.correlate(decoded[:4000], mono[:2000], mode="valid")))
    overlap = min(len(mono), len(decoded) - lag)
    assert np.corrcoef(decoded[lag : lag + overlap], mono[:overlap])[0, 1] > 0.95

    for call, match in (
        (lambda: AudioLoader().load_url((tmp_path / "clip.wav").as_uri()), "local files"),
        (lambda: loader.load_url("file:///etc/hostname"), "must lie under"),
        (lambda: loader.load_url("data:image/png;base64,AAAA"), "not an audio/ type"),
        (lambda: loader.load_input_audio("not base64!", "wav"), "not valid base64"),
        (lambda: loader.load_input_audio(base64.b64encode(b"junk").decode(), "wav"), "input_audio"),
        (lambda: loader.load_url(""), "needs a URL"),
    ):
        with pytest.raises(ValueError, match=match):
            call()


def test_two_tensor_parallel_ranks_with_audio(
    model_dir: Path, hf: Any, clips: dict[str, np.ndarray]
) -> None:
    """Rank 1 gets the clips' features over the wire and runs the whole tower itself (the
    text model is sharded): HF's answer."""
    request = {"prompt": TWO, "multi_modal_data": {"audio": [clips["c"], clips["b"]]}}
    [got] = two_rank_answers(model_dir, [request], params=PARAMS, num_kv_blocks=64)
    got.assert_matches(hf_answer(hf, model_dir, TWO, [clips["c"], clips["b"]]), "two ranks")
