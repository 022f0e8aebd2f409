"""What the multimodal test modules share to compare a model with HF transformers on a tiny
random checkpoint: the module's checkpoint fixtures (ours, HF's, the folder); which tensors
the loader reads; greedy answers (tokens and each token's logprob) from HF ``generate`` and
from ``LLM``; our prefill and one decode step's logits against HF's forward; the small
float32 engine (whole, chunked, on two tensor-parallel ranks); a chat turn with a PNG data URL.

Each model's own module keeps what is its own: the checkpoint, how HF's inputs are made, the
prompts, and which cases it checks. Fixtures here are module-scoped (one checkpoint a test
module, as before), so tests/test_fixture_imports.py's session rule does not apply.
"""

from __future__ import annotations

import base64
import gc
import io
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from fixtures_models import allocate_block_tables, make_attention_metadata, new_kv_caches
from test_models_parity import BLOCK_SIZE, NUM_BLOCKS, Runner

from chassis import LLM, SamplingParams
from chassis.core.attention import ForwardContext
from chassis.core.multimodal import MultiModalFeature

#: tokens each greedy answer has (EOS ignored)
NUM_TOKENS = 6
#: float32 parity: logits and logprobs
ATOL = 1e-4
#: greedy, ``NUM_TOKENS`` tokens whatever they are, each with its logprob
PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
#: the small float32 engine of these tests
ENGINE: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 128}
#: engine overrides for chunked prefill: steps of 16 tokens in 4-token blocks, which cut
#: through a media item's run of placeholder tokens
CHUNKED: dict[str, Any] = {"block_size": 4, "max_num_batched_tokens": 16}


class Answer(NamedTuple):
    """Greedy tokens and the logprob of each."""

    tokens: list[int]
    logprobs: list[float]

    def assert_matches(self, expected: Answer, what: str) -> None:
        """The same tokens, each logprob within :data:`ATOL`; ``what`` names the case."""
        assert self.tokens == expected.tokens, what
        np.testing.assert_allclose(self.logprobs, expected.logprobs, atol=ATOL, err_msg=what)


# -- the checkpoint ---------------------------------------------------------------------------


def checkpoint_fixtures(
    save: Callable[[Path], Path], load_hf: Callable[[Path], Any]
) -> tuple[Any, Any, Any]:
    """Module-scoped fixtures ``model_dir`` (``save`` of the tiny checkpoint into a temporary
    folder), ``hf`` (``load_hf`` of it: HF's float32 model) and ``runner`` (our model on it,
    :class:`Runner`). Bind them under those names in the test module:
    ``model_dir, hf, runner = checkpoint_fixtures(save_tiny_x, hf_model)``."""

    @pytest.fixture(scope="module", name="model_dir")
    def model_dir_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return save(tmp_path_factory.mktemp(save.__name__.removeprefix("save_tiny_")))

    @pytest.fixture(scope="module", name="hf")
    def hf_fixture(model_dir: Path) -> Any:
        return load_hf(model_dir)

    @pytest.fixture(scope="module", name="runner")
    def runner_fixture(model_dir: Path) -> Runner:
        return Runner(model_dir)

    return model_dir_fixture, hf_fixture, runner_fixture


def read_tensors(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[set[str], Any]:
    """The names of the checkpoint tensors the loader reads while building our model of
    ``model_dir``, and that model (``monkeypatch`` spies on the loader meanwhile)."""
    from chassis.core import model_loader

    read: list[str] = []
    original = model_loader.iterate_checkpoint

    def spy(*args: Any, **kwargs: Any) -> Any:
        for name, tensor in original(*args, **kwargs):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(model_loader, "iterate_checkpoint", spy)
    model = Runner(model_dir).model
    monkeypatch.undo()
    return set(read), model


def processor_fixture(inputs_class: Any) -> Any:
    """A module-scoped ``processor`` fixture: ``inputs_class.from_pretrained`` (a model's
    media-inputs processor) on the ``model_dir`` and ``runner`` of
    :func:`checkpoint_fixtures`. Bind it as ``processor``."""

    @pytest.fixture(scope="module", name="processor")
    def fixture(model_dir: Path, runner: Runner) -> Any:
        return inputs_class.from_pretrained(model_dir, runner.hf_config)

    return fixture


def hf_image_text_model(model_dir: Path) -> Any:
    """HF's ``AutoModelForImageTextToText`` of ``model_dir``: float32, in eval mode."""
    import transformers as tf

    return tf.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def arch_checkpoint_fixtures(
    save: Callable[[Path, str], Path],
    archs: Iterable[str],
    load_hf: Callable[[Path], Any] = hf_image_text_model,
) -> tuple[Any, Any, Any]:
    """Module-scoped fixtures of one tiny checkpoint per architecture of ``archs``, each a
    dict by architecture: ``model_dirs`` (``save(folder, arch)``), ``hf_models``
    (``load_hf``) and ``runners`` (:class:`Runner`). Bind them under those names:
    ``model_dirs, hf_models, runners = arch_checkpoint_fixtures(save_tiny_x, ARCHS)``."""
    archs = tuple(archs)

    @pytest.fixture(scope="module", name="model_dirs")
    def model_dirs_fixture(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
        return {arch: save(tmp_path_factory.mktemp(arch), arch) for arch in archs}

    @pytest.fixture(scope="module", name="hf_models")
    def hf_models_fixture(model_dirs: dict[str, Path]) -> dict[str, Any]:
        return {arch: load_hf(d) for arch, d in model_dirs.items()}

    @pytest.fixture(scope="module", name="runners")
    def runners_fixture(model_dirs: dict[str, Path]) -> dict[str, Runner]:
        return {arch: Runner(d) for arch, d in model_dirs.items()}

    return model_dirs_fixture, hf_models_fixture, runners_fixture


# -- HF's side --------------------------------------------------------------------------------


def hf_generate(hf: Any, inputs: Mapping[str, Any], num_tokens: int = NUM_TOKENS) -> Answer:
    """HF ``generate``'s greedy answer of ``num_tokens`` tokens (EOS ignored) on one prompt's
    processor ``inputs``, with each token's logprob (from float32 logits)."""
    with torch.no_grad():
        out = hf.generate(
            **inputs,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), dim=-1)[token])
        for step, token in zip(out.logits, tokens, strict=True)
    ]
    return Answer(tokens, logprobs)


def hf_logits(hf: Any, inputs: Mapping[str, Any]) -> torch.Tensor:
    """HF's forward on one prompt's ``inputs``: float32 logits, ``[num_tokens, vocab]``."""
    with torch.no_grad():
        return hf(**inputs).logits[0].float()


# -- our model, one prompt --------------------------------------------------------------------


def prefill_then_decode(
    runner: Runner, prompt: list[int], features: list[MultiModalFeature]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Our logits for the whole expanded ``prompt`` (one prefill step, each feature's rows,
    embedded as its own modality, in place of its run), then for one decode step of its
    greedy next token; and that token."""
    model = runner.model
    num_tokens = len(prompt)
    tables = allocate_block_tables([num_tokens + 1], BLOCK_SIZE, NUM_BLOCKS, runner.generator)
    kv = new_kv_caches(runner.hf_config, NUM_BLOCKS, BLOCK_SIZE)
    ids = torch.tensor(prompt)
    with torch.no_grad():
        embeds = model.embed_input_ids(ids)
        for feature in features:
            embeds[feature.offset : feature.end] = model.embed_multimodal(
                feature.modality, feature.tensors()
            )
        meta = make_attention_metadata([num_tokens], [num_tokens], tables, BLOCK_SIZE)
        hidden = model(ids, torch.arange(num_tokens), ForwardContext(meta, kv), embeds)
        prefill = model.compute_logits(hidden)
        token = int(prefill[-1].argmax())
        meta = make_attention_metadata([1], [num_tokens + 1], tables, BLOCK_SIZE)
        hidden = model(torch.tensor([token]), torch.tensor([num_tokens]), ForwardContext(meta, kv))
        decode = model.compute_logits(hidden)[0]
    return prefill, decode, token


def assert_prefill_and_decode_match(
    runner: Runner,
    hf: Any,
    inputs: Mapping[str, Any],
    features: list[MultiModalFeature],
) -> torch.Tensor:
    """Our prefill logits on HF's ``inputs`` (its ``input_ids`` with ``features`` in place)
    are HF's forward's to :data:`ATOL`, and so is the decode step of the greedy token (HF's
    argmax too) against HF on the prompt with that token appended. Returns our prefill
    logits."""
    prompt = inputs["input_ids"][0].tolist()
    prefill, decode, token = prefill_then_decode(runner, prompt, features)
    expected = hf_logits(hf, inputs)
    torch.testing.assert_close(prefill, expected, atol=ATOL, rtol=ATOL)
    assert token == int(expected[-1].argmax())
    longer = {**inputs, "input_ids": torch.cat([inputs["input_ids"], torch.tensor([[token]])], 1)}
    torch.testing.assert_close(decode, hf_logits(hf, longer)[-1], atol=ATOL, rtol=ATOL)
    return prefill


# -- through LLM ------------------------------------------------------------------------------


def media_prompts(cases: Iterable[tuple[str, list[Any]]], modality: str = "image") -> list[Any]:
    """``LLM.generate``'s prompts for ``(prompt, items)`` cases: a text prompt where there
    are no items, else the prompt with its ``modality`` items."""
    return [
        {"prompt": prompt, "multi_modal_data": {modality: items}} if items else prompt
        for prompt, items in cases
    ]


def answers(outputs: Iterable[Any]) -> list[Answer]:
    """Each ``RequestOutput``'s greedy answer: its first completion's tokens and logprobs."""
    return [answer for answer, _ in answers_and_cached(outputs)]


def answers_and_cached(outputs: Iterable[Any]) -> list[tuple[Answer, int]]:
    """Each output's answer (as :func:`answers`) and its number of prefix-cached prompt
    tokens."""
    result = []
    for output in outputs:
        completion = output.outputs[0]
        chosen = [
            step[token].logprob
            for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        result.append((Answer(list(completion.token_ids), chosen), output.num_cached_tokens))
    return result


def small_llm(model_dir: Path, **overrides: Any) -> LLM:
    """An offline engine over ``model_dir`` with :data:`ENGINE`'s settings, ``overrides``
    on top."""
    return LLM(str(model_dir), **{**ENGINE, **overrides})


def generate_answers(
    model_dir: Path, prompts: list[Any], *, params: SamplingParams = PARAMS, **overrides: Any
) -> list[Answer]:
    """The greedy answers (``params``: :data:`PARAMS` or another length) to ``prompts`` in
    one batch of a fresh :func:`small_llm` with ``overrides``, shut down after."""
    llm = small_llm(model_dir, **overrides)
    try:
        return answers(llm.generate(prompts, params))
    finally:
        llm.shutdown()


def two_rank_answers(
    model_dir: Path, prompts: list[Any], *, params: SamplingParams = PARAMS, **overrides: Any
) -> list[Answer]:
    """As :func:`generate_answers` with ``tensor_parallel_size=2``; waits until the rank
    worker processes are gone so that the next test starts clean."""
    from test_tensor_parallel import wait_for_no_workers

    llm = small_llm(model_dir, tensor_parallel_size=2, **overrides)
    try:
        got = answers(llm.generate(prompts, params))
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    wait_for_no_workers()
    return got


def png_data_url(picture: Any) -> str:
    """A ``data:image/png;base64,...`` URL of the PIL image ``picture``."""
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def image_url_part(url: str) -> dict[str, Any]:
    """A chat message's ``image_url`` content part of ``url``."""
    return {"type": "image_url", "image_url": {"url": url}}


def image_url_chat(url: str, text: str = "What is in the picture?") -> list[dict[str, Any]]:
    """One user turn of an ``image_url`` part with ``url``, then ``text``."""
    return [{"role": "user", "content": [image_url_part(url), {"type": "text", "text": text}]}]
