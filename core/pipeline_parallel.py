"""Pipeline parallelism (``--pipeline-parallel-size N``): which decoder layers each stage holds,
what a stage does not hold, and the checks made before any stage starts.

Each of the N stages (worker processes, as tensor parallelism's ranks:
``chassis.core.tp_executor``) builds and loads only a contiguous run of the decoder layers
(:func:`stage_layers`, vLLM's default split); the first stage also the token embeddings, the
last the final norm and the LM head. One batch is in flight at a time: stage ``s`` runs its
layers once stage ``s - 1`` has sent it the step's hidden states, so the split fits a model too
big for one device but does not make it faster. A model class opts in with
``CausalLM.supports_pipeline_parallel``.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

#: a checkpoint tensor of decoder layer N (``model.layers.N.…``)
_LAYER_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def stage_layers(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """Stage ``stage``'s decoder layers ``[start, end)`` of ``num_layers`` over ``num_stages``
    stages, as vLLM's default split: ``num_layers // num_stages`` each, the remainder one more
    each to the stages before the last, counting back from the one before the last (the last
    stage also runs the LM head). ``ValueError`` when a stage would hold no layer."""
    if num_layers < num_stages:
        raise ValueError(
            f"--pipeline-parallel-size {num_stages} is more than the model's "
            f"{num_layers} decoder layers (num_hidden_layers): every stage needs at least one"
        )
    parts = [num_layers // num_stages] * num_stages
    for i in range(2, num_layers % num_stages + 2):
        parts[-i] += 1
    start = sum(parts[:stage])
    return start, start + parts[stage]


def tensor_layer(name: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to (``model.layers.3.mlp…`` -> 3), or
    None for a tensor outside the layers (embeddings, final norm, LM head)."""
    match = _LAYER_TENSOR.search(name)
    return int(match.group(1)) if match else None


class MissingLayer(nn.Module):
    """Stands where a decoder layer of another pipeline stage is: no parameters, never run
    (its checkpoint tensors are skipped, ``CausalLM.needs_checkpoint_tensor``)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a decoder layer of another pipeline stage was run on this one")


def check_pipeline_parallel(model_cls: type, hf_config: Any, num_stages: int) -> None:
    """Before any stage starts: ``ValueError`` when ``model_cls`` does not declare
    ``supports_pipeline_parallel`` or the model has fewer decoder layers than stages."""
    if not getattr(model_cls, "supports_pipeline_parallel", False):
        raise ValueError(
            f"{model_cls.__name__} does not support --pipeline-parallel-size (its "
            "supports_pipeline_parallel is False); use --pipeline-parallel-size 1, or "
            "--tensor-parallel-size to split it over devices"
        )
    stage_layers(int(hf_config.num_hidden_layers), 0, num_stages)
