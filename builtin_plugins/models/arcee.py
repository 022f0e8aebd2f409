"""Arcee (AFM-4.5B): the Llama decoder with a non-gated ReLU² MLP.

As HF transformers' ``Arcee`` code defines it (its MLP is Nemotron's), the MLP is::

    down_proj(relu(up_proj(x)) ** 2)

with no ``gate_proj``; ``hidden_act`` is ``relu2``. Everything else is Llama's: pre-norm
RMSNorm, grouped-query attention with RoPE (the types :mod:`chassis.core.layers.rotary`
implements, YaRN included), ``attention_bias``/``mlp_bias``, no sliding window.

Only q/k/v are merged (``qkv_proj``); ``up_proj`` keeps its checkpoint name, and
:meth:`ArceeForCausalLM.load_weights` loads it as it is, past the Llama loader's gate/up
merge. Tensor parallelism is Llama's: ``up_proj`` is split by rows (column parallel) and
``down_proj`` by columns (row parallel), whose partial sums one all-reduce adds up.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaForCausalLM
from chassis.core import parallel_state
from chassis.core.model_interface import CausalLM, LoRASlice

#: the only ``hidden_act`` implemented (HF's ``ReLUSquaredActivation``)
ACTIVATION = "relu2"
#: the MLP's input projection, loaded whole (not into a merged gate/up matrix)
_UP_PROJ = "up_proj"


class ReLUSquaredMLP(nn.Module):
    """``down_proj(relu(up_proj(x)) ** 2)``; ``spec.intermediate_size`` is this rank's share
    of the columns, and the output is summed over the tensor-parallel group."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(torch.square(torch.relu(self.up_proj(x))))
        # Each rank holds some columns of the MLP: down_proj's partial sums add up.
        return parallel_state.all_reduce(out)


class ArceeForCausalLM(LlamaForCausalLM):
    """``ArceeForCausalLM`` checkpoints (arcee-ai AFM-4.5B, base and instruct).

    ``hidden_act`` must be ``relu2`` (a ``ValueError`` names another). A ``sliding_window``
    in the config is ignored, as HF's Arcee (a Llama config) ignores it.
    """

    #: only q/k/v are merged; ``up_proj`` and ``down_proj`` load under their own names
    merged_projections: Mapping[str, str] = {
        "q_proj": "qkv_proj",
        "k_proj": "qkv_proj",
        "v_proj": "qkv_proj",
    }
    lora_merged_projections: dict[str, tuple[str, ...]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    }

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(hf_config, activation=ACTIVATION, sliding_window=None)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        return ReLUSquaredMLP(self.spec)

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        """As Llama's, except ``up_proj``: one projection of its own (not the upper half of
        a merged gate/up layer), whose rows are split over a tensor-parallel group."""
        if module_name.rpartition(".")[2] != _UP_PROJ:
            return super().lora_slices(module_name, module)
        if not CausalLM.lora_slices(self, module_name, module):
            return []
        rows = int(module.out_features)
        tp = parallel_state.tp_size()
        return [LoRASlice(module_name, 0, rows, int(module.in_features), rows * tp)]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`LlamaForCausalLM.load_weights`, with each ``mlp.up_proj`` tensor copied
        into the module of that name (this rank's rows) instead of a merged gate/up one."""
        params = dict(self.named_parameters())
        filled: set[str] = set()

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                parts = name.split(".")
                if len(parts) < 2 or parts[-2] != _UP_PROJ:
                    yield name, tensor
                    continue
                param = params.get(name)
                if param is None:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has no counterpart in "
                        f"{type(self).__name__}; is the checkpoint's architecture right?"
                    )
                tensor = self._tensor_parallel_slice(name, tensor)
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                        f"{tuple(param.shape)} (does config.json match the weights?)"
                    )
                param.data.copy_(tensor)
                filled.add(name)

        return super().load_weights(others()) | filled
