"""A Gated DeltaNet layer's share on one tensor-parallel rank (as vLLM's
``Qwen3NextGatedDeltaNet`` splits it).

Each rank keeps ``num_k_heads / N`` contiguous key heads and, with them, the value heads
that read them (``num_v_heads / N``, the groups stay whole). HF's fused projections are laid
out group by group: ``in_proj_qkvz``'s rows are, per key head, ``[q | k | v | z]`` of the
group, and ``in_proj_ba``'s ``[b | a]`` of the group's value heads; so a rank's rows of
either are one contiguous run, and the local layer reads them with the same layout as the
whole one. The conv's channels are ``[q | k | v]`` over all heads: a rank keeps its heads'
channels of each part, in order. ``A_log`` and ``dt_bias`` are per value head; the gated
norm's weight is one ``v_head_dim`` vector applied per head (whole on every rank, and no
statistics cross ranks); ``out_proj`` is row-parallel (its input columns of this rank's value
heads; the partial outputs are summed over the group, and it has no bias).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from chassis.core.layers.gated_deltanet import GatedDeltaNetSpec


@dataclass(frozen=True)
class GatedDeltaNetShard:
    """Rank ``rank`` of ``size``'s share of a layer of shape ``full``: key heads
    ``first_k_head .. first_k_head + local.num_k_heads`` and value heads ``first_v_head ..
    first_v_head + local.num_v_heads``."""

    full: GatedDeltaNetSpec
    local: GatedDeltaNetSpec
    size: int
    rank: int
    first_k_head: int
    first_v_head: int

    def _conv_rows(self) -> torch.Tensor:
        """The indices of this rank's conv channels (of ``[q | k | v]``), in order."""
        full, local = self.full, self.local
        key_start = self.first_k_head * full.k_head_dim
        value_start = self.first_v_head * full.v_head_dim
        return torch.cat(
            [
                torch.arange(key_start, key_start + local.key_dim),
                full.key_dim + torch.arange(key_start, key_start + local.key_dim),
                2 * full.key_dim + torch.arange(value_start, value_start + local.value_dim),
            ]
        )

    def checkpoint_part(self, leaf: str, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """This rank's part of the layer's whole checkpoint tensor ``leaf``
        (``in_proj_qkvz.weight``, ``conv1d.weight``, ``A_log``, ...; ``what`` names it in
        errors). Unchanged for one rank; a ``ValueError`` when a fused tensor's rows do not
        match the config (rather than cutting the wrong rows)."""
        if self.size == 1:
            return tensor
        full, local = self.full, self.local
        module = leaf.split(".")[0]
        fused = {
            # rows per key head (one group), rows of the whole tensor
            "in_proj_qkvz": 2 * full.k_head_dim + 2 * full.heads_per_group * full.v_head_dim,
            "in_proj_ba": 2 * full.heads_per_group,
            "conv1d": None,
        }
        if module in fused:
            per_group = fused[module]
            expected = full.conv_dim if per_group is None else per_group * full.num_k_heads
            if tensor.shape[0] != expected:
                raise ValueError(
                    f"checkpoint tensor {what!r} has {tensor.shape[0]} rows, expected "
                    f"{expected} (does config.json match the weights?)"
                )
            if per_group is None:
                return tensor.index_select(0, self._conv_rows())
            start = self.first_k_head * per_group
            return tensor[start : start + local.num_k_heads * per_group]
        if module in ("A_log", "dt_bias"):
            return tensor[self.first_v_head : self.first_v_head + local.num_v_heads]
        if leaf == "out_proj.weight":
            start = self.first_v_head * full.v_head_dim
            return tensor[:, start : start + local.value_dim]
        return tensor  # the gated norm's weight: one head's, shared by all


def gated_deltanet_shard(spec: GatedDeltaNetSpec, size: int, rank: int) -> GatedDeltaNetShard:
    """Rank ``rank`` of ``size``'s :class:`GatedDeltaNetShard` of ``spec``; a ``ValueError``
    when the key heads (and so the groups of value heads) do not split evenly."""
    if spec.num_k_heads % size:
        raise ValueError(
            f"Gated DeltaNet's linear_num_key_heads ({spec.num_k_heads}) is not divisible by "
            f"--tensor-parallel-size {size} (each rank keeps whole groups of key and value "
            "heads)"
        )
    local_k = spec.num_k_heads // size
    local_v = spec.num_v_heads // size
    local = dataclasses.replace(spec, num_k_heads=local_k, num_v_heads=local_v)
    return GatedDeltaNetShard(
        full=spec,
        local=local,
        size=size,
        rank=rank,
        first_k_head=rank * local_k,
        first_v_head=rank * local_v,
    )
