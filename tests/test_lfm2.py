"""LFM2 (``Lfm2ForCausalLM``: gated short-conv layers and attention layers) against HF
transformers on tiny random float32 checkpoints.

Two checkpoints: the releases' shape (conv window 3, no conv biases, tied embeddings) and
one with conv biases, a window of 4 and an untied head. Every 1-D parameter (norms, biases)
is randomized (``save_tiny_checkpoint``). Logits must match HF's over a packed prefill, a
decode, a 2-token chunk over the carried state and a step mixing a chunk and a decode
(``check_logits`` of tests/state_space_helpers.py); greedy tokens through ``LLM`` must be HF
``generate``'s, also with chunked prefill, fewer state slots than requests and preemption,
and over two tensor-parallel ranks. A LoRA adapter naming the checkpoint's modules
(``feed_forward.w1``, ``self_attn.out_proj``, ``conv.in_proj``) gives HF's greedy tokens with
the adapter merged into its weights.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_lora import greedy_with_adapters, hf_greedy, hf_merged_model, lora_engine
from fixtures_lora import write_peft_adapter as write_adapter
from fixtures_models import TINY_CONFIG_FIELDS, save_tiny_checkpoint
from state_space_helpers import StateRunner, check_greedy_tokens, check_logits
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy
from test_llm_parity import hf_greedy as hf_text_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.lfm2 import Lfm2ForCausalLM, lfm2_layer_kinds
from chassis.core.lora import LoRARequest
from chassis.core.model_interface import ModelBuildContext

ARCHS = ("released", "conv_bias")


def tiny_config(arch: str, **overrides: Any) -> Any:
    from transformers import Lfm2Config

    fields = {
        key: TINY_CONFIG_FIELDS[key]
        for key in (
            "vocab_size",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
        )
    }
    fields.update(
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "conv"],
        intermediate_size=128,  # adjusted to 2/3, rounded up to 32: 96
        block_multiple_of=32,
        norm_eps=1e-5,
    )
    if arch == "conv_bias":
        fields.update(conv_bias=True, conv_L_cache=4, tie_word_embeddings=False)
    return Lfm2Config(**{**fields, **overrides})


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: save_tiny_checkpoint(tiny_config(arch), tmp_path_factory.mktemp(arch), seed=7)
        for arch in ARCHS
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    check_logits(model_dirs[arch])


def test_the_layers_are_read(model_dirs: dict[str, Path]) -> None:
    model = StateRunner(model_dirs["conv_bias"]).model
    kinds = [layer.conv is not None for layer in model.model.layers]
    assert kinds == [True, False, True, True] and model.num_attention_layers == 1
    assert model.model.layers[1].self_attn.attn.layer_idx == 0  # its KV cache
    assert [s.shape for s in model.request_state_specs()] == [(64, 3)] * 3
    assert [layer.conv.state_index for layer in model.model.layers if layer.conv] == [0, 1, 2]
    assert model.model.layers[0].mlp.down_proj.in_features == 96
    assert model.graph_capture_blocker() is not None


def test_unknown_layer_types_are_refused() -> None:
    config = tiny_config("released")
    config.layer_types = ["conv", "sliding_attention", "conv", "conv"]
    with pytest.raises(ValueError, match="sliding_attention"):
        Lfm2ForCausalLM(config, ModelBuildContext(TorchPagedAttention, torch.float32))
    config.layer_types = ["conv", "full_attention"]
    with pytest.raises(ValueError, match="each of the 4 layers"):
        lfm2_layer_kinds(config)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    check_greedy_tokens(model_dirs[arch])


@pytest.mark.parametrize("setting", ["chunked-prefill", "two-slots", "preemption"])
def test_engine_settings_keep_the_tokens(model_dirs: dict[str, Path], setting: str) -> None:
    check_greedy_tokens(model_dirs["released"], setting)


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_match_transformers(model_dirs: dict[str, Path]) -> None:
    """Two real ranks, each with half of every conv layer's channels (their rows of
    ``in_proj``'s three parts and of ``conv``, their ``out_proj`` columns, the ``out_proj``
    bias on rank 0), the attention heads and MLP columns: HF's greedy tokens, chunked."""
    model_dir = model_dirs["conv_bias"]
    expected = hf_text_greedy(model_dir, PROMPTS, MAX_TOKENS)
    got = chassis_greedy(
        model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2, max_num_batched_tokens=16
    )
    assert got == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()


#: every adaptable projection, by the checkpoint's names (``out_proj``: attention and conv)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3")


def test_lora_slices_carry_the_checkpoint_names(model_dirs: dict[str, Path]) -> None:
    model = StateRunner(model_dirs["released"]).model
    names = {
        s.hf_module
        for module_name, module in model.named_modules()
        if module_name.startswith(("model.layers.0.", "model.layers.1."))
        for s in model.lora_slices(module_name, module)
    }
    conv = {f"model.layers.0.conv.{leaf}" for leaf in ("in_proj", "out_proj")}
    attn = {f"model.layers.1.self_attn.{leaf}" for leaf in ("q_proj", "k_proj", "v_proj")}
    mlp = {f"model.layers.{i}.feed_forward.w{j}" for i in (0, 1) for j in (1, 2, 3)}
    assert names == conv | attn | mlp | {"model.layers.1.self_attn.out_proj"}


def test_lora_adapter_matches_hf_merged(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A random PEFT adapter on every projection (conv, attention and MLP layers): greedy
    tokens equal HF's with the adapter merged into its weights, and differ from the base."""
    model_dir = model_dirs["conv_bias"]
    adapter = write_adapter(tmp_path / "a", model_dir, targets=LORA_TARGETS)
    lora = LoRARequest("a", 1, str(adapter))
    prompts = [TOKEN_PROMPTS[0], TOKEN_PROMPTS[1]]
    got = greedy_with_adapters(lora_engine(model_dir), [lora, None], prompts, MAX_TOKENS)
    reference = hf_merged_model(model_dir, adapter)
    base = hf_merged_model(model_dir, None)
    assert got[0] == hf_greedy(reference, prompts[0], MAX_TOKENS)
    assert got[1] == hf_greedy(base, prompts[1], MAX_TOKENS)
    assert got[0] != hf_greedy(base, prompts[0], MAX_TOKENS)
