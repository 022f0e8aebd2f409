"""Checks shared by the tests of models with a per-request state (Mamba-1/2, Granite 4.0-H,
Bamba, Nemotron-H, Jamba, Falcon-H1, LFM2, Qwen3-Next): one model with paged KV caches and a
state pool (:class:`StateRunner`), logits against HF transformers over packed, decode,
chunked and mixed steps (:func:`check_logits`), greedy tokens through ``LLM`` under engine
settings that stress the state slots (:data:`ENGINE_SETTINGS`), and the smaller checks every
such model passes. Each test file keeps its tiny configs and what only its model does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import make_attention_metadata, save_tiny_checkpoint
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import hf_logits, load_hf

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.core.attention import ForwardContext, kv_cache_shape
from chassis.core.config import EngineConfig
from chassis.core.model_loader import build_model, load_hf_config
from chassis.core.request_state_cache import RequestStatePool

BLOCK_SIZE = 4
NUM_BLOCKS = 64

#: engine settings under which greedy tokens must stay HF's, by test id
ENGINE_SETTINGS: dict[str, dict[str, Any]] = {
    "plain": {},
    # chunked prefill, chunks of <= 7 tokens
    "chunked-prefill": {"max_num_batched_tokens": 7, "block_size": 4},
    # more requests than state slots: slots are reused
    "two-slots": {"max_num_seqs": 2},
    # too few KV blocks for all requests: a preempted request recomputes its state
    "preemption": {"num_kv_blocks": 28, "block_size": 4, "max_num_batched_tokens": 16},
    "async": {"async_scheduling": True, "max_num_batched_tokens": 16, "block_size": 4},
}

#: checkpoints saved so far in this run, by the caller's key (see :func:`saved_checkpoint`)
_CHECKPOINTS: dict[str, Path] = {}
#: HF models loaded so far in this run, by checkpoint directory
_HF_MODELS: dict[Path, Any] = {}


def saved_checkpoint(
    factory: pytest.TempPathFactory, key: str, config: Callable[[], Any], seed: int
) -> Path:
    """A tiny random checkpoint of ``config()`` (``save_tiny_checkpoint``), saved once per
    run under ``key``: test files that use the same checkpoint share its directory (and so
    :func:`hf_greedy`'s cached answers for it)."""
    if key not in _CHECKPOINTS:
        _CHECKPOINTS[key] = save_tiny_checkpoint(config(), factory.mktemp(key), seed=seed)
    return _CHECKPOINTS[key]


def hf_model(model_dir: Path) -> Any:
    """HF's float32 model of ``model_dir``, loaded once per run (only ever run in eval
    mode, never changed)."""
    model_dir = Path(model_dir)
    if model_dir not in _HF_MODELS:
        _HF_MODELS[model_dir] = load_hf(model_dir)
    return _HF_MODELS[model_dir]


class StateRunner:
    """Our model, paged KV caches for its attention layers and a request-state pool."""

    def __init__(self, model_dir: Path, num_slots: int = 4) -> None:
        hf_config = load_hf_config(model_dir)
        config = EngineConfig(model=str(model_dir))
        self.model = build_model(
            config, hf_config, model_dir, TorchPagedAttention, "cpu", torch.float32
        )
        heads = getattr(hf_config, "num_attention_heads", 1)
        kv_heads = getattr(hf_config, "num_key_value_heads", heads)
        shape = kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, kv_heads, hf_config.hidden_size // heads)
        self.kv_caches = [torch.zeros(shape) for _ in range(self.model.num_attention_layers)]
        self.pool = RequestStatePool(self.model.request_state_specs(), num_slots, "cpu")

    def step(
        self, tokens: list[list[int]], seq_lens: list[int], request_ids: list[str]
    ) -> torch.Tensor:
        query_lens = [len(t) for t in tokens]
        per_request = NUM_BLOCKS // 4
        tables = [
            list(range(int(r) * per_request, (int(r) + 1) * per_request)) for r in request_ids
        ]
        metadata = make_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
        ids = torch.tensor([t for seq in tokens for t in seq])
        positions = torch.tensor(
            [p for q, s in zip(query_lens, seq_lens, strict=True) for p in range(s - q, s)]
        )
        ctx = ForwardContext(metadata, self.kv_caches)
        ctx.request_states = self.pool.tensors
        ctx.state_slots = torch.from_numpy(self.pool.slots(request_ids))
        with torch.no_grad():
            return self.model.compute_logits(self.model(ids, positions, ctx))

    def use_reference(self, mixer_cls: type[torch.nn.Module], reference: bool = True) -> None:
        """Switch every ``mixer_cls`` layer's ``use_reference`` (its token-by-token scan)."""
        for module in self.model.modules():
            if isinstance(module, mixer_cls):
                module.use_reference = reference  # type: ignore[assignment]


def check_logits(model_dir: Path, atol: float = 1e-4) -> None:
    """HF's logits over two requests' prefill packed in one step, a decode each from the
    carried states (and KV), a 2-token chunk each, then a step mixing a 3-token chunk and a
    decode."""
    runner = StateRunner(model_dir)
    hf = hf_model(model_dir)
    prompts = [TOKEN_PROMPTS[0] * 2, TOKEN_PROMPTS[1]]  # 26 and 3 tokens
    ids = ["0", "1"]
    for r in ids:
        runner.pool.allocate(r)
    seq_lens = [len(p) for p in prompts]
    logits = runner.step(prompts, seq_lens, ids)
    start, following = 0, []
    for prompt in prompts:
        expected = hf_logits(hf, prompt)
        torch.testing.assert_close(
            logits[start : start + len(prompt)], expected, atol=atol, rtol=1e-4
        )
        following.append(int(expected[-1].argmax()))
        start += len(prompt)
    # one decode each, from the carried states (and KV)
    logits = runner.step([[t] for t in following], [n + 1 for n in seq_lens], ids)
    extended = [[*p, t] for p, t in zip(prompts, following, strict=True)]
    for i, tokens in enumerate(extended):
        torch.testing.assert_close(logits[i], hf_logits(hf, tokens)[-1], atol=atol, rtol=1e-4)
    # a 2-token chunk each over the carried state
    logits = runner.step([[5, 77], [9, 11]], [n + 3 for n in seq_lens], ids)
    for i, (tokens, more) in enumerate(zip(extended, ([5, 77], [9, 11]), strict=True)):
        expected = hf_logits(hf, tokens + more)[-2:]
        torch.testing.assert_close(logits[2 * i : 2 * i + 2], expected, atol=atol, rtol=1e-4)
        extended[i] = tokens + more
    # a mixed step: a 3-token chunk for the first request, one token for the second
    logits = runner.step([[8, 9, 10], [12]], [seq_lens[0] + 6, seq_lens[1] + 4], ids)
    expected = hf_logits(hf, extended[0] + [8, 9, 10])[-3:]
    torch.testing.assert_close(logits[:3], expected, atol=atol, rtol=1e-4)
    expected = hf_logits(hf, extended[1] + [12])[-1]
    torch.testing.assert_close(logits[3], expected, atol=atol, rtol=1e-4)


def check_prefill(runner: StateRunner, model_dir: Path, prompt: list[int]) -> None:
    """A fresh request's prefill of ``prompt`` (slot ``"0"``) gives HF's logits."""
    runner.pool.allocate("0")
    logits = runner.step([prompt], [len(prompt)], ["0"])
    expected = hf_logits(hf_model(model_dir), prompt)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def check_forward_without_state_slots(model_dir: Path) -> None:
    """A memory-profiling forward (no pool in the context) is a fresh prefill and keeps
    nothing: HF's logits, the pool untouched."""
    runner = StateRunner(model_dir)
    prompt = TOKEN_PROMPTS[0]
    metadata = make_attention_metadata([len(prompt)], [len(prompt)], [list(range(4))], BLOCK_SIZE)
    ctx = ForwardContext(metadata, runner.kv_caches)
    with torch.no_grad():
        logits = runner.model.compute_logits(
            runner.model(torch.tensor(prompt), torch.arange(len(prompt)), ctx)
        )
    expected = hf_logits(hf_model(model_dir), prompt)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert all(not t.any() for t in runner.pool.tensors)


def check_greedy_tokens(model_dir: Path, setting: str = "plain") -> None:
    """All prompts (1 to 40 tokens) in one ``generate`` under :data:`ENGINE_SETTINGS`
    ``[setting]``: HF ``generate``'s greedy tokens (and, for ``preemption``, a preemption
    happened)."""
    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams

    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    engine = ENGINE_SETTINGS[setting]
    if "num_kv_blocks" not in engine:  # (chassis_greedy sets its own)
        assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected
        return
    llm = LLM(str(model_dir), dtype="float32", max_model_len=100, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected


def check_logprobs(model_dir: Path) -> None:
    """Each sampled token's logprob (prompts of different lengths in one batch) is HF's
    log-softmax at that position over the whole sequence."""
    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams
    from chassis.core.tokenizer import load_tokenizer

    prompts = PROMPTS[1:4]
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params)
    hf = hf_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    for prompt, output in zip(prompts, outputs, strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        completion = output.outputs[0]
        logits = hf_logits(hf, prompt_ids + completion.token_ids)
        expected = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
        assert completion.token_ids == expected.argmax(-1).tolist()
        got = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
        want = expected.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=1e-4)


def check_prefix_caching_off(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The engine turns prefix caching off for the model, and says so in the log."""
    from chassis.core.llm import LLM

    with caplog.at_level(logging.INFO, logger="chassis.core.request_state_cache"):
        llm = LLM(str(model_dir), dtype="float32", max_model_len=64, num_kv_blocks=32)
    assert llm.config.enable_prefix_caching is False
    assert "prefix caching is off" in caplog.text


def check_spec_decoding_refused(model_dir: Path) -> None:
    """Speculative decoding is refused at start."""
    from chassis.core.llm import LLM

    with pytest.raises(ValueError, match="speculative decoding"):
        LLM(
            str(model_dir),
            dtype="float32",
            max_model_len=64,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
