"""Models build under a non-CPU default device (what ``build_model`` does on a GPU).

``build_model`` constructs the model inside ``with torch.device(device)``. Code that mixes an
explicit ``device="cpu"`` tensor with one that follows the default device works on the CPU
and fails on any accelerator; the ``meta`` device shows such a mix here, without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.llama import LlamaForCausalLM
from chassis.builtin_plugins.models.qwen2 import Qwen2ForCausalLM
from chassis.builtin_plugins.models.qwen3 import Qwen3ForCausalLM
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import ModelBuildContext

SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    ("model_cls", "config"),
    [
        (LlamaForCausalLM, LlamaConfig(**SIZES)),
        (LlamaForCausalLM, LlamaConfig(**SIZES, rope_scaling=LLAMA3_ROPE)),
        (Qwen2ForCausalLM, Qwen2Config(**SIZES)),
        (Qwen3ForCausalLM, Qwen3Config(**SIZES, head_dim=32)),
    ],
    ids=["llama", "llama3-rope", "qwen2", "qwen3"],
)
def test_models_build_under_a_non_cpu_default_device(model_cls, config):
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = model_cls(config, ctx)
    devices = {t.device.type for t in [*model.parameters(), *model.buffers()]}
    assert devices == {"meta"}


def test_rotary_tables_are_computed_in_float32_on_the_cpu_then_moved():
    params = {"rope_type": "default", "rope_theta": 10000.0}
    reference = RotaryEmbedding(16, 32, params)
    with torch.device("meta"):
        moved = RotaryEmbedding(16, 32, params)
    assert moved.cos_cache.device.type == "meta"
    assert moved.cos_cache.dtype == reference.cos_cache.dtype == torch.float32
    assert moved.cos_cache.shape == reference.cos_cache.shape == (32, 8)
