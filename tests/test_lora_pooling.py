"""LoRA adapters on pooling engines: embeddings, classification and scores with adapters,
against HF transformers with each adapter's deltas merged into the weights (what PEFT's
``merge_and_unload`` computes: ``W += scaling * B @ A``), pooled the same way, float32.

A tiny random Llama serves embeddings (last token, normalized) and a tiny random 3-label Llama
classifier serves classification; one batch mixes the base model and two adapters, with
prompts longer than the token budget (chunked) and a second pass over the prefix cache, whose
entries must stay per adapter. A real ``chassis serve --runner pooling --enable-lora``
answers ``/v1/embeddings``, ``/pooling`` and ``/score`` for an adapter named as ``model``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fixtures_classify import hf_classifier, write_tiny_classifier
from fixtures_lora import hf_merged_model, write_peft_adapter
from server_process import ServerProcess, running_server

from chassis.core.errors import RequestFailedError
from chassis.core.llm import LLM
from chassis.core.lora import LoRARequest
from chassis.core.pooling_params import PoolingParams

TOLERANCE = 1e-5
#: a token budget below the longest prompts: they are pooled over several steps
BUDGET = 24
BLOCK = 16


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(n)] for n in lengths]


#: three prompts of different lengths, two over the token budget
PROMPTS = _prompts([40, 9, 29])


def _engine(model_dir: Path, **kwargs: Any) -> LLM:
    settings: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": 128,
        "num_kv_blocks": 64,
        "block_size": BLOCK,
        "max_num_batched_tokens": BUDGET,
        "enforce_eager": True,
        "enable_lora": True,
        "max_loras": 2,
        "max_lora_rank": 8,
    }
    settings.update(kwargs)
    return LLM(str(model_dir), **settings)


def _merged(model: Any, adapter_dir: Path) -> Any:
    """``model`` (an HF float32 model whose module names are the adapter's) with the
    adapter's ``scaling * B @ A`` added to each adapted weight."""
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." in key:
                b = tensors[key.replace(".lora_A.", ".lora_B.")]
                name = key.removeprefix("base_model.model.").split(".lora_A.")[0]
                scaling = config["lora_alpha"] / a.shape[0]
                model.get_submodule(name).weight += scaling * (b @ a)
    return model


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two adapters of the tiny Llama: rank 8 on every projection, rank 4 on attention."""
    root = tmp_path_factory.mktemp("pooling_adapters")
    return {
        "a": write_peft_adapter(root / "a", tiny_llama_dir, seed=1, rank=8),
        "b": write_peft_adapter(
            root / "b", tiny_llama_dir, seed=2, rank=4, targets=("q_proj", "v_proj", "o_proj")
        ),
    }


@pytest.fixture(scope="module")
def references(tiny_llama_dir: Path, adapters: dict[str, Path]) -> dict[str | None, Any]:
    """HF decoders (no LM head) of the base model (key None) and of each merged adapter."""
    made: dict[str | None, Any] = {None: hf_merged_model(tiny_llama_dir, None).model}
    for name, folder in adapters.items():
        made[name] = hf_merged_model(tiny_llama_dir, folder).model
    return made


def _embedding(decoder: Any, token_ids: list[int]) -> torch.Tensor:
    """HF's last-token, L2-normalized embedding of ``token_ids`` (float32)."""
    with torch.inference_mode():
        hidden = decoder(torch.tensor([token_ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden.float(), dim=-1)


def _lora(adapters: dict[str, Path], name: str | None) -> LoRARequest | None:
    return (
        None
        if name is None
        else LoRARequest(name, 1 + sorted(adapters).index(name), str(adapters[name]))
    )


@pytest.fixture(scope="module")
def embedder(tiny_llama_dir: Path) -> Iterator[LLM]:
    llm = _engine(tiny_llama_dir, runner="pooling")
    yield llm
    llm.shutdown()


# -- embeddings ----------------------------------------------------------------------------------


def test_mixed_batch_embeds_each_prompt_with_its_adapter(
    embedder: LLM, adapters: dict[str, Path], references: dict[str | None, Any]
) -> None:
    """Base model and two adapters in one batch (chunked prompts), twice: the second pass
    hits the prefix cache of each prompt's own adapter. Every vector equals HF's merged model's
    and differs from the other adapters' (so the adapter did run)."""
    names: list[str | None] = [None, "a", "b", "a", "b", None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    loras = [_lora(adapters, n) for n in names]
    for again in (False, True):
        outputs = embedder.embed(prompts, lora_request=loras)
        for name, prompt, out in zip(names, prompts, outputs, strict=True):
            # the second time, every full block before the last token is a hit
            assert out.num_cached_tokens == ((len(prompt) - 1) // BLOCK * BLOCK if again else 0)
            got = torch.tensor(out.outputs.embedding)
            torch.testing.assert_close(
                got, _embedding(references[name], prompt), atol=TOLERANCE, rtol=0
            )
            for other in {None, "a", "b"} - {name}:
                assert (got - _embedding(references[other], prompt)).abs().max() > 1e-2


def test_a_request_the_engine_core_refuses_carries_its_error(
    embedder: LLM, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An id given to another folder, past the front-end's check: the engine core refuses
    that request alone and says why (the request's fault); ``embed`` raises it, and the
    engine serves the adapter on."""
    first = _lora(adapters, "a")
    assert first is not None
    ok = embedder.embed(PROMPTS[1:2], lora_request=first)[0]
    monkeypatch.setattr(embedder.input_processor, "check_lora", lambda lora_request: None)
    other = LoRARequest("other", first.lora_int_id, str(adapters["b"]))
    with pytest.raises(RequestFailedError, match="cannot take it") as failed:
        embedder.embed(PROMPTS[:2], lora_request=[other, first])
    assert failed.value.error.client_error
    assert str(adapters["a"]) in str(failed.value) and str(adapters["b"]) in str(failed.value)
    # the id still runs its own adapter
    monkeypatch.undo()
    again = embedder.embed(PROMPTS[1:2], lora_request=first)[0]
    torch.testing.assert_close(
        torch.tensor(again.outputs.embedding),
        torch.tensor(ok.outputs.embedding),
        atol=TOLERANCE,
        rtol=0,
    )


def test_prefix_cache_entries_stay_with_their_adapter(
    embedder: LLM, adapters: dict[str, Path], references: dict[str | None, Any]
) -> None:
    """A prompt embedded by the base model and then by an adapter computes it afresh (no hit
    on the base model's blocks); the same adapter again hits its own blocks."""
    prompt = _prompts([2 * BLOCK + 5], seed=7)[0]
    lora = _lora(adapters, "a")
    [base] = embedder.embed([prompt])
    [first] = embedder.embed([prompt], lora_request=lora)
    [again] = embedder.embed([prompt], lora_request=[lora])
    assert base.num_cached_tokens == 0 and first.num_cached_tokens == 0
    assert again.num_cached_tokens == 2 * BLOCK
    for out, name in ((base, None), (first, "a"), (again, "a")):
        torch.testing.assert_close(
            torch.tensor(out.outputs.embedding),
            _embedding(references[name], prompt),
            atol=TOLERANCE,
            rtol=0,
        )


def test_score_with_an_adapter_is_the_cosine_of_its_embeddings(
    embedder: LLM, adapters: dict[str, Path], references: dict[str | None, Any]
) -> None:
    """Bi-encoder score: both texts of a pair embedded with the pair's adapter (one for all,
    or one per pair)."""
    query, docs = PROMPTS[1], [PROMPTS[0], PROMPTS[2]]
    per_pair = [_lora(adapters, "b"), None]
    for loras in (_lora(adapters, "a"), per_pair):
        names = ["a", "a"] if isinstance(loras, LoRARequest) else ["b", None]
        scores = [o.outputs.score for o in embedder.score(query, docs, lora_request=loras)]
        for name, doc, score in zip(names, docs, scores, strict=True):
            want = torch.dot(_embedding(references[name], query), _embedding(references[name], doc))
            assert abs(score - float(want)) < TOLERANCE
    with pytest.raises(ValueError, match="one per pair; got 1 for 2 pairs"):
        embedder.score(query, docs, lora_request=[None])


def test_adapters_are_checked_before_anything_runs(
    embedder: LLM, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """As for generation: a folder that is not an adapter, and an id given to another one."""
    embedder.embed(PROMPTS[:1], lora_request=_lora(adapters, "a"))  # id 1 is adapter a
    with pytest.raises(ValueError, match="does not exist"):
        embedder.embed(PROMPTS[:1], lora_request=LoRARequest("x", 9, str(tmp_path / "none")))
    with pytest.raises(ValueError, match="already names adapter"):
        embedder.embed(PROMPTS[:1], lora_request=LoRARequest("x", 1, str(adapters["b"])))
    # score embeds each distinct text once per adapter: another folder under id 1 is still
    # checked (and refused), not merged with adapter a's embedding of the same text
    impostor = LoRARequest("x", 1, str(adapters["b"]))
    with pytest.raises(ValueError, match="already names adapter 'a'"):
        embedder.score(PROMPTS[0], [PROMPTS[1]] * 2, lora_request=[_lora(adapters, "a"), impostor])
    with pytest.raises(ValueError, match="got 1 LoRA requests for 2 prompts"):
        embedder.embed(PROMPTS[:2], lora_request=[None])


# -- classification ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_classifier("llama", tmp_path_factory.mktemp("lora_cls"), 3)


def test_classify_with_an_adapter_equals_the_merged_hf_classifier(
    classifier_dir: Path, tmp_path: Path
) -> None:
    """The adapter changes the decoder; the ``score`` head is the base model's (it is no
    LoRA target, and adapters that save it whole, ``modules_to_save``, are refused)."""
    adapter = write_peft_adapter(
        tmp_path / "cls", classifier_dir, seed=3, config_overrides={"task_type": "SEQ_CLS"}
    )
    lora = LoRARequest("cls", 1, str(adapter))
    llm = _engine(classifier_dir)
    try:
        assert "score" not in (llm.engine.info.lora_target_shapes or {})
        prompts = PROMPTS[:2]
        outputs = llm.classify(prompts, lora_request=[lora, None])
        merged, base = (
            _merged(hf_classifier(classifier_dir), adapter),
            hf_classifier(classifier_dir),
        )
        for prompt, out, model in zip(prompts, outputs, (merged, base), strict=True):
            with torch.inference_mode():
                logits = model(torch.tensor([prompt])).logits[0].float()
            torch.testing.assert_close(
                torch.tensor(out.outputs.probs), logits.softmax(-1), atol=TOLERANCE, rtol=0
            )
        raw = llm.classify(prompts[:1], PoolingParams(use_activation=False), lora_request=lora)
        with torch.inference_mode():
            logits = merged(torch.tensor([prompts[0]])).logits[0].float()
            base_logits = base(torch.tensor([prompts[0]])).logits[0].float()
        torch.testing.assert_close(
            torch.tensor(raw[0].outputs.probs), logits, atol=TOLERANCE, rtol=0
        )
        assert (logits - base_logits).abs().max() > 1e-2  # the adapter matters

        saved_head = write_peft_adapter(
            tmp_path / "head",
            classifier_dir,
            seed=4,
            config_overrides={"task_type": "SEQ_CLS", "modules_to_save": ["classifier", "score"]},
        )
        with pytest.raises(ValueError, match=r"modules_to_save: \['classifier', 'score'\]"):
            llm.classify(prompts[:1], lora_request=LoRARequest("head", 2, str(saved_head)))
        lora_on_head = _with_score_pair(adapter, tmp_path / "score_pair")
        with pytest.raises(ValueError, match="changes 'score', which this model cannot apply"):
            llm.classify(prompts[:1], lora_request=LoRARequest("pair", 3, str(lora_on_head)))
    finally:
        llm.shutdown()


def test_cross_encoder_scores_each_pair_with_its_adapter(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A one-label Qwen3 classifier: each pair's sequence (token ids: the two lists one after
    the other) with the pair's adapter, through the sigmoid, equals HF's merged model's."""
    model_dir = write_tiny_classifier("qwen3", tmp_path_factory.mktemp("lora_ce"), 1, seed=2)
    adapter = write_peft_adapter(tmp_path_factory.mktemp("ce_adapter"), model_dir, seed=5)
    lora = LoRARequest("ce", 1, str(adapter))
    llm = _engine(model_dir)
    try:
        query, docs = PROMPTS[1], [PROMPTS[2], PROMPTS[0][:12]]
        scores = [o.outputs.score for o in llm.score(query, docs, lora_request=[lora, None])]
    finally:
        llm.shutdown()
    models = (_merged(hf_classifier(model_dir), adapter), hf_classifier(model_dir))
    for doc, score, model in zip(docs, scores, models, strict=True):
        with torch.inference_mode():
            logit = model(torch.tensor([query + doc])).logits[0, 0].float()
        assert abs(score - float(torch.sigmoid(logit))) < TOLERANCE
    with torch.inference_mode():  # the adapter matters for the first pair
        base_logit = models[1](torch.tensor([query + docs[0]])).logits[0, 0].float()
    assert abs(scores[0] - float(torch.sigmoid(base_logit))) > 1e-3


def _with_score_pair(source: Path, directory: Path) -> Path:
    """A copy of the adapter ``source`` that also holds a LoRA pair for the ``score`` head."""
    from safetensors.torch import load_file, save_file

    directory.mkdir()
    (directory / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    tensors = load_file(str(source / "adapter_model.safetensors"))
    tensors["base_model.model.score.lora_A.weight"] = torch.randn(8, 64)
    tensors["base_model.model.score.lora_B.weight"] = torch.randn(3, 8)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


# -- the server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    extra = [
        "--runner", "pooling", "--max-num-batched-tokens", str(BUDGET), "--enable-lora",
        "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"a={adapters['a']}", f"b={adapters['b']}",
    ]  # fmt: skip
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("serve"), extra_args=extra) as s:
        yield s


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base + path, json=body, headers=server.headers, timeout=60)


def test_server_routes_pool_with_the_adapter_named_as_model(
    server: ServerProcess, references: dict[str | None, Any]
) -> None:
    """``/v1/embeddings`` (the official client), ``/pooling`` and ``/score`` with an adapter's
    name as ``model``: HF's merged vectors, and the name asked for in the answer."""
    client = server.client()
    for name in ("a", "b", None):
        model = name or server.model
        answer = client.embeddings.create(model=model, input=PROMPTS, encoding_format="float")
        assert answer.model == model
        for prompt, item in zip(PROMPTS, answer.data, strict=True):
            torch.testing.assert_close(
                torch.tensor(item.embedding),
                _embedding(references[name], prompt),
                atol=TOLERANCE,
                rtol=0,
            )
    pooled = _post(server, "/pooling", {"model": "b", "input": PROMPTS[2]})
    assert pooled.status_code == 200, pooled.text
    torch.testing.assert_close(
        torch.tensor(pooled.json()["data"][0]["data"]),
        _embedding(references["b"], PROMPTS[2]),
        atol=TOLERANCE,
        rtol=0,
    )
    texts = ["What is the capital of France?", "Paris is."]
    scored = _post(server, "/score", {"model": "a", "text_1": texts[0], "text_2": texts[1]})
    assert scored.status_code == 200, scored.text
    assert scored.json()["model"] == "a"
    ids = [client.embeddings.create(model="a", input=t, encoding_format="float") for t in texts]
    vectors = [torch.tensor(e.data[0].embedding) for e in ids]
    assert abs(scored.json()["data"][0]["score"] - float(torch.dot(*vectors))) < TOLERANCE


def test_server_refuses_unknown_models_and_lists_adapters(server: ServerProcess) -> None:
    """An unknown ``model`` is a 404 ``model_not_found`` naming what is served, on every
    pooling route, as for generation; ``/v1/models`` lists the adapters."""
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().embeddings.create(model="nope", input="hello")
    assert "'a', 'b'" in str(caught.value)
    for path, body in (
        ("/pooling", {"input": "hello"}),
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
    ):
        answer = _post(server, path, {"model": "nope", **body})
        assert answer.status_code == 404, (path, answer.text)
        assert answer.json()["error"]["code"] == "model_not_found"
    listed = httpx.get(server.base + "/v1/models", headers=server.headers, timeout=10).json()
    cards = {card["id"]: card for card in listed["data"]}
    assert list(cards) == [server.model, "a", "b"]
    assert cards["a"]["parent"] == server.model
