"""LoRA adapters whose folder changes after the front-end checked it, and LoRA with
``--torch-compile``.

An adapter is read when the engine core accepts a request for it and does not hold it in
host memory; a folder deleted, truncated or unreadable by then fails that request alone
(finish reason ``abort`` and an error naming the adapter and the cause offline, a 500 with
code ``request_failed`` through the server), while the other requests of the
same steps run as before, the engine stays up, and the adapter runs again once its folder
is back. The compiled forward with adapters generates the eager engine's greedy tokens.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from fixtures_lora import hf_greedy, hf_merged_model, write_peft_adapter
from server_process import ServerProcess, start_server

from chassis.core.llm import LLM
from chassis.core.lora import LoRARequest
from chassis.core.request import EngineCoreRequest
from chassis.core.sampling_params import SamplingParams

NEW_TOKENS = 6
PROMPT = [1, 422, 3108, 314, 9216, 253, 1345, 2442, 88, 913, 402, 1033]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_sources(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two adapters (kept aside: tests copy them where they may break them) and the HF
    greedy tokens of each, and of the base model, for :data:`PROMPT`."""
    root = tmp_path_factory.mktemp("sources")
    sources = {
        "a": write_peft_adapter(root / "a", tiny_llama_dir, rank=8, seed=11),
        "b": write_peft_adapter(root / "b", tiny_llama_dir, rank=4, seed=12),
    }
    expected = {
        name: hf_greedy(hf_merged_model(tiny_llama_dir, path), PROMPT, NEW_TOKENS)
        for name, path in (*sources.items(), ("base", None))
    }
    assert len({tuple(tokens) for tokens in expected.values()}) == 3  # adapters matter
    return {"paths": sources, "expected": expected}


def _copy(sources: dict, name: str, root: Path) -> Path:
    target = root / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(sources["paths"][name], target)
    return target


def _run(llm: LLM, loras: list[LoRARequest | None]) -> list[tuple[str | None, list[int]]]:
    outputs = llm.generate([PROMPT] * len(loras), GREEDY, lora_request=loras)
    return [(o.outputs[0].finish_reason, list(o.outputs[0].token_ids)) for o in outputs]


# -- offline --------------------------------------------------------------------------------------


def _make_llm(tiny_llama_dir: Path, **engine: object) -> LLM:
    """One slot and one adapter kept in host memory: an adapter not run last is read again."""
    return LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=32,
        block_size=4,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=1,
        max_lora_rank=8,
        **engine,
    )


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> Iterator[LLM]:
    engine = _make_llm(tiny_llama_dir)
    yield engine
    engine.shutdown()


def _lora_model(llm: LLM):
    return llm.engine.executor.worker.lora


BREAKAGES = ["deleted", "truncated", "garbage", "unreadable"]


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_an_adapter_broken_after_its_check_fails_only_its_requests(
    llm: LLM,
    adapter_sources: dict,
    tmp_path: Path,
    breakage: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if breakage == "unreadable" and os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    expected = adapter_sources["expected"]
    number = BREAKAGES.index(breakage)  # ids are never shared between adapters
    a = LoRARequest("a", 100 + number, str(_copy(adapter_sources, "a", tmp_path)))
    b = LoRARequest("b", 200 + number, str(_copy(adapter_sources, "b", tmp_path)))
    # Both checked and run; b ran last, so a is no longer held in host memory.
    assert _run(llm, [a, b]) == [("length", expected["a"]), ("length", expected["b"])]
    assert a.lora_int_id not in _lora_model(llm)._read

    weights = Path(a.lora_path) / "adapter_model.safetensors"
    if breakage == "deleted":
        shutil.rmtree(a.lora_path)
    elif breakage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif breakage == "garbage":
        weights.write_bytes(b"\x00garbage" * 64)
    else:
        weights.chmod(0)
    # One step holds requests of a (refused), b and the base model.
    with caplog.at_level(logging.ERROR, logger="chassis.core.engine_core"):
        outputs = llm.generate([PROMPT] * 4, GREEDY, lora_request=[a, b, None, a])
    got = [(o.outputs[0].finish_reason, list(o.outputs[0].token_ids)) for o in outputs]
    assert got == [
        ("abort", []),
        ("length", expected["b"]),
        ("length", expected["base"]),
        ("abort", []),
    ]
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 2 and all(a.lora_path in message for message in refusals)
    # the caller is told which adapter and why, as the engine's fault (a 500 in the server)
    causes = {
        "deleted": ["does not exist"],
        "truncated": ["is not a readable safetensors file"],
        "garbage": ["is not a readable safetensors file"],
        "unreadable": ["is not a readable safetensors file", "cannot be read"],
    }[breakage]
    for index in (0, 3):
        error = outputs[index].outputs[0].error
        assert error is not None and not error.client_error
        assert error.message.startswith(
            f"LoRA adapter 'a' (id {a.lora_int_id}) cannot be loaded from {a.lora_path}: "
        )
        assert any(cause in error.message for cause in causes)
    assert all(outputs[index].outputs[0].error is None for index in (1, 2))
    assert _lora_model(llm).pinned_ids == []  # every pin was given back

    # The folder comes back: the adapter runs again (read anew), beside the others.
    _copy(adapter_sources, "a", tmp_path)
    assert _run(llm, [b, a, None]) == [
        ("length", expected["b"]),
        ("length", expected["a"]),
        ("length", expected["base"]),
    ]


def test_an_adapter_held_in_host_memory_runs_without_its_folder(
    llm: LLM, adapter_sources: dict, tmp_path: Path
) -> None:
    a = LoRARequest("a", 300, str(_copy(adapter_sources, "a", tmp_path)))
    assert _run(llm, [a]) == [("length", adapter_sources["expected"]["a"])]
    shutil.rmtree(a.lora_path)
    # a is the adapter held (max_cpu_loras 1): its folder is not read again
    assert _run(llm, [a, a]) == [("length", adapter_sources["expected"]["a"])] * 2


def test_pins_follow_the_requests_of_the_engine_core(
    llm: LLM, adapter_sources: dict, tmp_path: Path
) -> None:
    """Each adapter is pinned once while requests use it, and given back when the last one
    finishes or is aborted, also one that never ran."""
    core = llm.engine
    lora = _lora_model(llm)
    a = LoRARequest("a", 400, str(_copy(adapter_sources, "a", tmp_path)))
    llm.input_processor.check_lora(a)

    def request(request_id: str) -> EngineCoreRequest:
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=PROMPT,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
            lora_request=a,
        )

    core.add_request(request("r1"))
    core.add_request(request("r2"))
    assert lora.pinned_ids == [a.lora_int_id] and lora._pinned[a.lora_int_id][1] == 1
    core.abort_requests(["r1"])
    assert lora.pinned_ids == [a.lora_int_id]
    core.abort_requests(["r2", "unknown"])
    assert lora.pinned_ids == []
    core.add_request(request("r3"))
    finished = set()
    while core.has_unfinished():
        finished |= {o.request_id for o in core.step().outputs if o.finished}
    assert "r3" in finished
    assert lora.pinned_ids == [] and core._lora_refs == {} and core._lora_of == {}


def test_tensor_parallel_ranks_refuse_a_deleted_adapter_together(
    tiny_llama_dir: Path, adapter_sources: dict, tmp_path: Path
) -> None:
    """Every rank pins the adapter or none does: a folder deleted before a request fails that
    request on both ranks, and the group keeps serving."""
    expected = adapter_sources["expected"]
    llm = _make_llm(tiny_llama_dir, tensor_parallel_size=2)
    try:
        a = LoRARequest("a", 1, str(_copy(adapter_sources, "a", tmp_path)))
        b = LoRARequest("b", 2, str(_copy(adapter_sources, "b", tmp_path)))
        assert _run(llm, [a, b]) == [("length", expected["a"]), ("length", expected["b"])]
        shutil.rmtree(a.lora_path)
        got = _run(llm, [a, b, None])
        assert got == [("abort", []), ("length", expected["b"]), ("length", expected["base"])]
        _copy(adapter_sources, "a", tmp_path)
        assert _run(llm, [a]) == [("length", expected["a"])]
        assert _lora_model(llm).pinned_ids == []
    finally:
        llm.shutdown()


# -- through the server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, adapter_sources: dict, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, Path]]:
    root = tmp_path_factory.mktemp("served")
    for name in ("a", "b"):
        _copy(adapter_sources, name, root)
    args = ["--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1", "--max-lora-rank", "8"]
    modules = ["--lora-modules", f"a={root / 'a'}", f"b={root / 'b'}"]
    server = start_server(
        tiny_llama_dir, tmp_path_factory.mktemp("serve_log"), extra_args=[*args, *modules]
    )
    yield server, root
    server.stop()


def _complete(server: ServerProcess, model: str) -> tuple[str, list[int]]:
    response = server.client().completions.create(
        model=model,
        prompt=PROMPT,
        temperature=0,
        max_tokens=NEW_TOKENS,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = response.choices[0]
    return choice.finish_reason, choice.model_extra["token_ids"]


def test_the_server_fails_only_the_request_of_a_deleted_adapter(
    server: tuple[ServerProcess, Path], adapter_sources: dict
) -> None:
    process, root = server
    expected = adapter_sources["expected"]
    assert _complete(process, "a") == ("length", expected["a"])
    assert _complete(process, "b") == ("length", expected["b"])  # a leaves host memory
    shutil.rmtree(root / "a")
    with pytest.raises(openai.InternalServerError) as failed:
        _complete(process, "a")
    assert failed.value.status_code == 500
    assert failed.value.code == "request_failed"
    assert "LoRA adapter 'a'" in failed.value.message and "does not exist" in failed.value.message
    with pytest.raises(openai.APIError, match="does not exist"):  # streamed: the error event
        list(
            process.client().completions.create(
                model="a", prompt=PROMPT, max_tokens=NEW_TOKENS, stream=True
            )
        )
    assert _complete(process, "b") == ("length", expected["b"])
    assert _complete(process, "tiny") == ("length", expected["base"])
    assert httpx.get(process.base + "/health", headers=process.headers).status_code == 200
    _copy(adapter_sources, "a", root)
    assert _complete(process, "a") == ("length", expected["a"])


# -- --torch-compile -------------------------------------------------------------------------------


def test_adapters_with_torch_compile_match_hf_without_recompiling(
    tiny_llama_dir: Path, adapter_sources: dict
) -> None:
    """The compiled forward runs the adapter matmuls in every step (over a zero mask
    without adapters): two graphs at start-up (any token count, one token), no graph break,
    nothing compiled while steps with and without adapters, mixed and chunked, run."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=32,
        block_size=4,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_num_batched_tokens=16,  # prefill chunks beside decodes
        torch_compile=True,
    )
    assert counters["stats"]["unique_graphs"] == 2
    assert dict(counters["graph_break"]) == {}
    expected = adapter_sources["expected"]
    a = LoRARequest("a", 1, str(adapter_sources["paths"]["a"]))
    b = LoRARequest("b", 2, str(adapter_sources["paths"]["b"]))
    assert _run(llm, [None]) == [("length", expected["base"])]
    got = _run(llm, [a, b, None, a])
    assert got == [("length", expected[n]) for n in ("a", "b", "base", "a")]
    assert counters["stats"]["unique_graphs"] == 2
    assert dict(counters["graph_break"]) == {}
