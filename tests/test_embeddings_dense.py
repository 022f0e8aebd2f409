"""Sentence-transformers ``Dense`` and ``LayerNorm`` modules and the max / sqrt-length /
weighted-mean poolings on a pooling engine, against a reference computed here from HF transformers' hidden states.

The checkpoint is the tiny random Llama (hidden size 64) with sentence-transformers folders
added: ``1_Pooling``, ``2_Dense`` (64 -> 48, bias, tanh; ``model.safetensors``),
``3_Dense`` (48 -> 24, no bias, identity; ``pytorch_model.bin``) and ``4_Normalize``. The
reference is written out in torch below (pool, then each ``x @ W.T + b`` and activation,
then truncate, then normalize: sentence-transformers' order), independently of chassis'
pooler. Prompts longer than the token budget make the poolers carry state across chunks.
With ``layer_norm``, a ``LayerNorm`` (48, ``pytorch_model.bin``) and a ``Dropout`` follow
``2_Dense``; the reference writes the layer norm out by hand.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fixtures_lora import hf_merged_model, write_peft_adapter
from server_process import running_server
from test_embeddings import pooling_llm, random_prompts, run_low_then_high

from chassis.core.lora import LoRARequest
from chassis.core.pooling_layer_norm import layer_norm
from chassis.core.pooling_outputs import decode_pooled
from chassis.core.pooling_params import PoolingParams

TOLERANCE = 1e-5
HIDDEN = 64
#: (folder, in, out, bias, activation name, activation, weights file)
LAYERS = [
    ("2_Dense", HIDDEN, 48, True, "torch.nn.modules.activation.Tanh", torch.tanh, "safetensors"),
    ("3_Dense", 48, 24, False, "torch.nn.modules.linear.Identity", lambda x: x, "bin"),
]
OUT = 24
_MODES = {
    "mean": "pooling_mode_mean_tokens",
    "max": "pooling_mode_max_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
    "last": "pooling_mode_lasttoken",
    "cls": "pooling_mode_cls_token",
    "weighted_mean": "pooling_mode_weightedmean_tokens",
}
_ST = "sentence_transformers.models."


def _write_st_model(
    source: Path,
    target: Path,
    mode: str,
    *,
    dense: bool = True,
    layer_norm: bool = False,
    config_extra: dict[str, Any] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Copy ``source`` to ``target`` with sentence-transformers folders; returns each Dense
    folder's random (weight, bias). ``layer_norm``: a ``LayerNorm`` module (random weight and
    bias, saved as sentence-transformers' ``LayerNorm.save`` does: ``{"dimension": 48}`` and
    ``norm.*`` in ``pytorch_model.bin``) and a ``Dropout`` follow ``2_Dense``; its
    (weight, bias) is returned as ``2_LayerNorm``'s."""
    from safetensors.torch import save_file

    shutil.copytree(source, target)
    if config_extra:
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**config, **config_extra}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": _ST + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": _ST + "Pooling"},
    ]
    (target / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": HIDDEN, **{k: False for k in _MODES.values()}}
    (target / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, _MODES[mode]: True}))
    weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    generator = torch.Generator().manual_seed(7)
    for folder, n_in, n_out, has_bias, activation, _, fmt in LAYERS if dense else []:
        modules.append({"idx": len(modules), "name": folder, "path": folder, "type": _ST + "Dense"})
        (target / folder).mkdir()
        config = {
            "in_features": n_in,
            "out_features": n_out,
            "bias": has_bias,
            "activation_function": activation,
        }
        (target / folder / "config.json").write_text(json.dumps(config))
        weight = torch.randn(n_out, n_in, generator=generator) / math.sqrt(n_in)
        bias = torch.randn(n_out, generator=generator) * 0.1 if has_bias else None
        tensors = {"linear.weight": weight, **({"linear.bias": bias} if has_bias else {})}
        if fmt == "safetensors":
            save_file(tensors, str(target / folder / "model.safetensors"))
        else:
            torch.save(tensors, target / folder / "pytorch_model.bin")
        weights[folder] = (weight, bias)
        if layer_norm and folder == "2_Dense":
            weights["2_LayerNorm"] = _write_layer_norm(target, modules, n_out, generator)
    modules.append(
        {"idx": len(modules), "name": "n", "path": "4_Normalize", "type": _ST + "Normalize"}
    )
    (target / "4_Normalize").mkdir()
    (target / "modules.json").write_text(json.dumps(modules))
    return weights


def _write_layer_norm(
    target: Path, modules: list[dict[str, Any]], dimension: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    for folder, kind in (("2_LayerNorm", "LayerNorm"), ("2_Dropout", "Dropout")):
        modules.append({"idx": len(modules), "name": folder, "path": folder, "type": _ST + kind})
        (target / folder).mkdir()
    (target / "2_LayerNorm" / "config.json").write_text(json.dumps({"dimension": dimension}))
    (target / "2_Dropout" / "config.json").write_text(json.dumps({"dropout": 0.2}))
    weight = 1 + 0.5 * torch.randn(dimension, generator=generator)
    bias = 0.3 * torch.randn(dimension, generator=generator)
    torch.save(
        {"norm.weight": weight, "norm.bias": bias}, target / "2_LayerNorm" / "pytorch_model.bin"
    )
    return weight, bias


def _reference(
    decoder: Any,
    token_ids: list[int],
    mode: str,
    weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
    *,
    normalize: bool = True,
    dimensions: int | None = None,
) -> torch.Tensor:
    """sentence-transformers' pipeline, written out: pool HF's final hidden states, run the
    Dense layers, keep the first ``dimensions`` values, L2-normalize."""
    with torch.inference_mode():
        hidden = decoder(torch.tensor([token_ids])).last_hidden_state[0].float()
    if mode == "mean":
        vector = hidden.sum(dim=0) / hidden.shape[0]
    elif mode == "max":
        vector = torch.amax(hidden, dim=0)
    elif mode == "mean_sqrt_len":
        vector = hidden.sum(dim=0) / math.sqrt(hidden.shape[0])
    elif mode == "weighted_mean":  # token i (from 0) weighs i + 1
        position_weights = torch.arange(1, hidden.shape[0] + 1, dtype=torch.float32)
        vector = (hidden * position_weights[:, None]).sum(dim=0) / position_weights.sum()
    elif mode == "last":
        vector = hidden[-1]
    else:
        vector = hidden[0]
    for folder, *_, activation, _fmt in LAYERS:
        if folder in weights:
            weight, bias = weights[folder]
            vector = vector @ weight.T + (0 if bias is None else bias)
            vector = activation(vector)
        if folder == "2_Dense" and "2_LayerNorm" in weights:  # torch.nn.LayerNorm, eps 1e-5
            scale, shift = weights["2_LayerNorm"]
            centred = vector - vector.mean()
            variance = (centred * centred).mean()  # the biased variance, as LayerNorm's
            vector = centred / torch.sqrt(variance + 1e-5) * scale + shift
    if dimensions is not None:
        vector = vector[:dimensions]
    return vector / vector.norm() if normalize else vector


def _assert_close(got: list[float], expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), expected, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.fixture(scope="module")
def decoder(tiny_llama_dir: Path) -> Any:
    from transformers import AutoModel

    return AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("mode", ["mean", "max", "mean_sqrt_len", "weighted_mean", "last"])
def test_dense_chain_matches_the_reference(
    tiny_llama_dir: Path, decoder: Any, tmp_path: Path, mode: str
) -> None:
    weights = _write_st_model(tiny_llama_dir, tmp_path / "st", mode)
    llm = pooling_llm(tmp_path / "st")
    assert [d.out_features for d in llm.pooler_config.dense] == [48, OUT]
    assert llm.embedding_info.hidden_size == OUT
    prompts = random_prompts([100, 3, 50, 1, 25], seed=2)  # several chunks, and one-token prompts
    params = [PoolingParams(normalize=i != 1) for i in range(len(prompts))]
    outputs = llm.embed(prompts, params)
    for prompt, param, output in zip(prompts, params, outputs, strict=True):
        assert output.outputs.hidden_size == OUT
        expected = _reference(decoder, prompt, mode, weights, normalize=bool(param.normalize))
        _assert_close(output.outputs.embedding, expected)
    llm.shutdown()


@pytest.mark.parametrize("mode", ["mean", "last"])
def test_layer_norm_and_dropout_in_the_chain_match_the_reference(
    tiny_llama_dir: Path, decoder: Any, tmp_path: Path, mode: str
) -> None:
    """Pooling -> Dense -> LayerNorm -> Dropout (the identity) -> Dense -> Normalize."""
    weights = _write_st_model(tiny_llama_dir, tmp_path / "st", mode, layer_norm=True)
    llm = pooling_llm(tmp_path / "st")
    assert [d.out_features for d in llm.pooler_config.dense] == [48, 48, OUT]
    prompts = random_prompts([100, 3, 50, 1], seed=11)
    params = [PoolingParams(normalize=i != 1) for i in range(len(prompts))]
    for prompt, param, output in zip(prompts, params, llm.embed(prompts, params), strict=True):
        expected = _reference(decoder, prompt, mode, weights, normalize=bool(param.normalize))
        _assert_close(output.outputs.embedding, expected)
    # the LayerNorm changes the vectors: the same checkpoint without it differs
    without = {k: v for k, v in weights.items() if k != "2_LayerNorm"}
    plain = _reference(decoder, prompts[0], mode, without)
    assert not torch.allclose(torch.tensor(llm.embed([prompts[0]])[0].outputs.embedding), plain)
    llm.shutdown()


@pytest.mark.parametrize("mode", ["max", "mean_sqrt_len", "weighted_mean"])
def test_max_sqrt_len_and_weighted_pooling_without_dense(
    tiny_llama_dir: Path, decoder: Any, tmp_path: Path, mode: str
) -> None:
    _write_st_model(tiny_llama_dir, tmp_path / "st", mode, dense=False)
    llm = pooling_llm(tmp_path / "st")
    assert llm.pooler_config.pooling_type == mode.upper()
    assert not llm.config.enable_prefix_caching  # they read every token's state
    prompts = random_prompts([70, 5, 26], seed=4)
    for prompt, output in zip(prompts, llm.embed(prompts), strict=True):
        assert output.outputs.hidden_size == HIDDEN
        _assert_close(output.outputs.embedding, _reference(decoder, prompt, mode, {}))
    llm.shutdown()


def test_dense_then_matryoshka_then_normalize(
    tiny_llama_dir: Path, decoder: Any, tmp_path: Path
) -> None:
    """``dimensions`` is checked against the Dense output size and cuts the projected
    vector, which is then normalized on its own; a user pooler_config keeps the Dense."""
    weights = _write_st_model(
        tiny_llama_dir, tmp_path / "st", "mean", config_extra={"is_matryoshka": True}
    )
    llm = pooling_llm(tmp_path / "st", pooler_config={"pooling_type": "CLS"})
    assert llm.pooler_config.pooling_type == "CLS" and len(llm.pooler_config.dense) == 2
    with pytest.raises(ValueError, match=f"exceeds the model's embedding size {OUT}"):
        llm.embed(["text"], PoolingParams(dimensions=32))
    prompts = random_prompts([40, 9], seed=5)
    outputs = llm.embed(prompts, [PoolingParams(dimensions=8), PoolingParams(dimensions=OUT)])
    _assert_close(
        outputs[0].outputs.embedding, _reference(decoder, prompts[0], "cls", weights, dimensions=8)
    )
    _assert_close(outputs[1].outputs.embedding, _reference(decoder, prompts[1], "cls", weights))
    llm.shutdown()


def test_lora_adapter_pools_through_the_dense_chain(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """An adapter changes the decoder; the Dense modules are the checkpoint's, for every
    request: base and adapted prompts in one batch."""
    weights = _write_st_model(tiny_llama_dir, tmp_path / "st", "mean")
    adapter = write_peft_adapter(tmp_path / "adapter", tiny_llama_dir, seed=1, rank=8)
    llm = pooling_llm(
        tmp_path / "st", enable_lora=True, max_loras=1, max_lora_rank=8, block_size=16
    )
    prompts = random_prompts([40, 9, 29], seed=6)
    lora = LoRARequest("a", 1, str(adapter))
    requests = [lora, None, lora]
    outputs = llm.embed(prompts, lora_request=requests)
    decoders = {
        None: hf_merged_model(tiny_llama_dir, None).model,
        "a": hf_merged_model(tiny_llama_dir, adapter).model,
    }
    for prompt, request, output in zip(prompts, requests, outputs, strict=True):
        decoder = decoders[None if request is None else "a"]
        _assert_close(output.outputs.embedding, _reference(decoder, prompt, "mean", weights))
    llm.shutdown()


def test_preempted_sqrt_len_request_pools_its_tokens_once(
    tiny_llama_dir: Path, decoder: Any, tmp_path: Path
) -> None:
    """A low-priority 60-token prompt preempted (by recompute) after three 16-token steps by
    a high-priority one: its running sum starts again; both vectors equal the reference."""
    weights = _write_st_model(tiny_llama_dir, tmp_path / "st", "mean_sqrt_len")
    llm = pooling_llm(
        tmp_path / "st",
        max_model_len=64,
        num_kv_blocks=4,  # one 64-token sequence
        max_num_batched_tokens=16,
        scheduler="priority",
    )
    low, high = random_prompts([60, 60], seed=9)
    results = run_low_then_high(llm, low, high)
    assert llm.engine.scheduler.num_preemptions == 1
    for request_id, ids in (("low", low), ("high", high)):
        got = decode_pooled(results[request_id].pooled)
        _assert_close(list(got), _reference(decoder, ids, "mean_sqrt_len", weights))
    llm.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_run_the_dense_chain_as_one(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Tensor parallelism: every rank loads the Dense modules and pools alike (max pooling
    over chunked prompts); the driver's vectors equal a single rank's."""
    _write_st_model(tiny_llama_dir, tmp_path / "st", "max")
    prompts = random_prompts([100, 3, 50, 1, 25], seed=10)
    one = pooling_llm(tmp_path / "st")
    expected = [o.outputs.embedding for o in one.embed(prompts)]
    one.shutdown()
    two = pooling_llm(tmp_path / "st", tensor_parallel_size=2)
    try:
        got = [o.outputs.embedding for o in two.embed(prompts)]
    finally:
        two.shutdown()
    for g, e in zip(got, expected, strict=True):
        assert len(g) == OUT
        torch.testing.assert_close(torch.tensor(g), torch.tensor(e), atol=1e-5, rtol=0)


def _edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_layer_norm_is_torchs_with_its_default_epsilon() -> None:
    """sentence-transformers' LayerNorm module is ``torch.nn.LayerNorm(dimension)``: on
    vectors whose variance is near the epsilon (where 1e-5 and any other value differ by far
    more than rounding) chassis' function gives that module's values."""
    generator = torch.Generator().manual_seed(3)
    module = torch.nn.LayerNorm(16)
    with torch.no_grad():
        module.weight.copy_(1 + 0.5 * torch.randn(16, generator=generator))
        module.bias.copy_(0.3 * torch.randn(16, generator=generator))
    vectors = 3e-3 * torch.randn(4, 16, generator=generator)  # variance ~1e-5
    with torch.no_grad():
        expected = module(vectors)
    got = layer_norm(module.weight.detach(), module.bias.detach())(vectors)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    no_eps = torch.nn.functional.layer_norm(vectors, (16,), module.weight, module.bias, 0.0)
    assert not torch.allclose(got, no_eps.detach(), atol=1e-3, rtol=1e-3)


def test_dense_modules_chassis_cannot_run_are_refused_at_start(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    cases: list[tuple[Callable[[Path], None], str]] = [
        (
            lambda d: _edit(
                d / "2_Dense" / "config.json",
                lambda c: c.update(activation_function="torch.nn.modules.activation.Hardswish"),
            ),
            r"activation_function 'torch.nn.modules.activation.Hardswish' is not supported",
        ),
        (
            lambda d: _edit(d / "2_Dense" / "config.json", lambda c: c.update(in_features=32)),
            r"in_features 32 does not match the pooled vector's size 64",
        ),
        (
            lambda d: _edit(d / "3_Dense" / "config.json", lambda c: c.update(in_features=40)),
            r"in_features 40 does not match the previous Dense's out_features 48",
        ),
        (
            lambda d: (d / "3_Dense" / "pytorch_model.bin").unlink(),
            r"3_Dense: no weights file \(model.safetensors or pytorch_model.bin\)",
        ),
        (
            lambda d: _edit(d / "3_Dense" / "config.json", lambda c: c.update(bias=True)),
            r"the config says bias but there is no linear.bias tensor",
        ),
        (
            lambda d: _edit(
                d / "modules.json",
                lambda m: m.insert(2, m.pop()),  # Normalize before Dense
            ),
            r"Pooling -> Normalize -> Dense -> Dense are not supported",
        ),
    ]
    layer_norm_cases: list[tuple[Callable[[Path], None], str]] = [
        (
            lambda d: _edit(d / "2_LayerNorm" / "config.json", lambda c: c.update(dimension=40)),
            r"2_LayerNorm/config.json: dimension 40 does not match the previous Dense's "
            r"out_features 48",
        ),
        (
            lambda d: _edit(d / "3_Dense" / "config.json", lambda c: c.update(in_features=40)),
            r"3_Dense/config.json: in_features 40 does not match the previous LayerNorm's "
            r"dimension 48",
        ),
        (
            lambda d: torch.save(
                {"norm.weight": torch.ones(48)}, d / "2_LayerNorm" / "pytorch_model.bin"
            ),
            r"2_LayerNorm/pytorch_model.bin: no norm.bias tensor",
        ),
        (
            lambda d: _edit(d / "modules.json", lambda m: m.insert(1, m.pop(3))),
            r"Transformer -> LayerNorm -> Pooling -> Dense -> Dropout",
        ),
        (
            lambda d: _edit(
                d / "modules.json",
                lambda m: m.insert(1, {"path": "w", "type": _ST + "WordWeights"}),
            ),
            r"WordWeights \(a weight per vocabulary token, applied to each token's hidden state "
            r"before the pooling\) is not supported",
        ),
    ]
    for i, (break_it, message) in enumerate(cases + layer_norm_cases):
        model_dir = tmp_path / f"m{i}"
        _write_st_model(tiny_llama_dir, model_dir, "mean", layer_norm=i >= len(cases))
        break_it(model_dir)
        with pytest.raises(ValueError, match=message):
            pooling_llm(model_dir)
    # a wrong weight shape names the file and both shapes
    model_dir = tmp_path / "shape"
    _write_st_model(tiny_llama_dir, model_dir, "mean")
    torch.save({"linear.weight": torch.zeros(24, 47)}, model_dir / "3_Dense" / "pytorch_model.bin")
    with pytest.raises(
        ValueError, match=r"linear.weight has shape \[24, 47\], config says \[24, 48\]"
    ):
        pooling_llm(model_dir)


# -- server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, dict[str, tuple[torch.Tensor, torch.Tensor | None]]]]:
    root = tmp_path_factory.mktemp("dense_server")
    weights = _write_st_model(
        tiny_llama_dir, root / "st", "mean", config_extra={"matryoshka_dimensions": [8, OUT]}
    )
    extra = ["--runner", "pooling", "--max-num-batched-tokens", "32"]
    with running_server(root / "st", root, extra_args=extra) as server:
        yield server, weights


def test_server_embeddings_have_the_dense_output_size(
    dense_server: tuple[Any, dict[str, Any]], decoder: Any
) -> None:
    server, weights = dense_server
    ids = random_prompts([45], seed=8)[0]
    url, headers = f"{server.base}/v1/embeddings", server.headers
    body: dict[str, Any] = {"model": server.model, "input": [ids, ids[:5]]}
    response = httpx.post(url, json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [len(d["embedding"]) for d in data] == [OUT, OUT]
    _assert_close(data[0]["embedding"], _reference(decoder, ids, "mean", weights))
    body = {"model": server.model, "input": [ids], "dimensions": 8}
    response = httpx.post(url, json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()["data"][0]["embedding"]) == 8
    body["dimensions"] = 16  # not one of the model's matryoshka dimensions
    response = httpx.post(url, json=body, headers=headers, timeout=60)
    assert response.status_code == 400
    assert "[8, 24]" in response.json()["error"]["message"]
