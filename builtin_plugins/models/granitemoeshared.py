"""IBM Granite MoE with a shared MLP: Granite MoE (:mod:`~chassis.builtin_plugins.models.
granitemoe`) whose layers also run every token through one SwiGLU MLP.

As HF transformers' ``GraniteMoeShared`` code defines it, what differs from Llama is
Granite MoE's (multipliers, stacked experts, top-k softmax router), plus:

- ``shared_intermediate_size`` > 0: each layer has a ``shared_mlp`` (``input_linear``
  ``[2 * S, H]``: the gate rows, then the up rows; ``output_linear`` ``[H, S]``, no biases)
  whose output is added to the experts' before the residual multiplier scales their sum.
  With 0 there is none (then the model is Granite MoE).

Here the shared MLP is a :class:`~chassis.builtin_plugins.models.llama.LlamaMLP` inside each
layer's :class:`~chassis.builtin_plugins.models.granitemoe.GraniteMoeBlock`: its fused
``input_linear`` is cut into ``gate_proj`` and ``up_proj`` as it loads, so that under tensor
parallelism each rank holds its columns of both halves (``shared_intermediate_size`` must
divide by the ranks; with expert parallelism too, the shared MLP staying split by columns as
Qwen2-MoE's shared expert does), and the experts and the shared MLP share one all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from chassis.builtin_plugins.models.granitemoe import GraniteMoeForCausalLM

#: a checkpoint's shared-MLP projections -> ours (``input_linear`` is cut in two)
_SHARED_MLP = {"input_linear": ("gate_proj", "up_proj"), "output_linear": ("down_proj",)}


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """``GraniteMoeSharedForCausalLM`` checkpoints (ibm-research/moe-7b-1b-active-shared-experts,
    HF's example of the architecture).

    As :class:`~chassis.builtin_plugins.models.granitemoe.GraniteMoeForCausalLM`, with each
    layer's ``shared_mlp.*`` loaded into its block's ``mlp.shared_mlp``. Refused as Granite
    MoE's options are, and a ``shared_intermediate_size`` that does not divide by
    ``--tensor-parallel-size``.
    """

    @classmethod
    def shared_intermediate_size(cls, hf_config: Any) -> int:
        return int(getattr(hf_config, "shared_intermediate_size", 0) or 0)

    def checkpoint_tensors(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """As Granite MoE's, and ``<layer>.shared_mlp.input_linear.weight`` as
        ``<layer>.mlp.shared_mlp.gate_proj.weight`` and ``up_proj`` (its two halves, views),
        ``output_linear`` as ``down_proj`` (a ``ValueError`` when ``input_linear``'s rows
        are not twice ``shared_intermediate_size``)."""
        prefix, _, leaf = name.rpartition(".")
        layer, _, projection = prefix.rpartition(".")
        if not (layer.endswith(".shared_mlp") and projection in _SHARED_MLP):
            yield from super().checkpoint_tensors(name, tensor)
            return
        target = layer.removesuffix(".shared_mlp") + ".mlp.shared_mlp"
        if projection == "output_linear":
            yield f"{target}.down_proj.{leaf}", tensor
            return
        size = self.shared_intermediate_size(self.hf_config)
        if tensor.shape[0] != 2 * size:
            raise ValueError(
                f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected "
                f"2 * shared_intermediate_size = {2 * size} (does config.json match the "
                "weights?)"
            )
        gate, up = tensor.split(size)
        yield f"{target}.gate_proj.{leaf}", gate
        yield f"{target}.up_proj.{leaf}", up
