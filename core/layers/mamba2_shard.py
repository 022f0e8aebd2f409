"""A Mamba2 mixer's share on one tensor-parallel rank (as vLLM's ``MambaMixer2`` splits it).

Each rank keeps ``num_heads / N`` contiguous heads: their columns of the gate ``z`` and of
``x`` (``head_dim`` channels each), their ``dt``, ``dt_bias``, ``A_log`` and ``D``, and the
matching ``out_proj`` input columns (a row-parallel projection: the partial outputs are
summed over the group, its bias added by rank 0 alone). ``B`` and ``C`` belong to groups of
heads: with ``n_groups`` divisible by ``N`` each rank keeps its ``n_groups / N`` groups; with
fewer groups than ranks (``N`` divisible by ``n_groups``, the usual ``n_groups`` 1) each rank
keeps a copy of the one group its heads read. Anything else is a ``ValueError``.

The checkpoint's fused tensors are cut part by part: ``in_proj``'s rows ``[z | x | B | C |
dt]`` and ``conv1d``'s channels ``[x | B | C]`` each become this rank's rows of every part,
in the same order, so the local layer is a whole Mamba2 mixer of the local sizes
(:attr:`Mamba2Shard.local`). The gated RMSNorm normalizes per group: a rank holding whole
groups normalizes them alone; a group spread over several ranks needs the sum of squares of
all its channels, which :class:`~chassis.core.layers.mamba2_mixer.GatedRMSNorm` sums over the
group (:attr:`Mamba2Shard.ranks_per_group` > 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from chassis.core.layers.mamba2_mixer import Mamba2Spec


@dataclass(frozen=True)
class Mamba2Shard:
    """Rank ``rank`` of ``size``'s share of a mixer of shape ``full``: heads
    ``first_head .. first_head + local.num_heads``, groups ``first_group .. first_group +
    local.n_groups`` (one replicated group when ``ranks_per_group`` > 1)."""

    full: Mamba2Spec
    local: Mamba2Spec
    size: int
    rank: int
    first_head: int
    first_group: int
    #: how many ranks share each group (1: every rank holds whole groups)
    ranks_per_group: int

    def _rows(self, parts: tuple[str, ...]) -> torch.Tensor:
        """The indices of this rank's rows of a fused tensor made of ``parts`` (of ``z``,
        ``x``, ``B``, ``C``, ``dt``), in order."""
        full, local = self.full, self.local
        group_width = full.n_groups * full.d_state
        widths = {
            "z": full.intermediate_size,
            "x": full.intermediate_size,
            "B": group_width,
            "C": group_width,
            "dt": full.num_heads,
        }
        channel = self.first_head * full.head_dim
        # (part's first row of ours, our row count) within each part
        mine = {
            "z": (channel, local.intermediate_size),
            "x": (channel, local.intermediate_size),
            "B": (self.first_group * full.d_state, local.n_groups * full.d_state),
            "C": (self.first_group * full.d_state, local.n_groups * full.d_state),
            "dt": (self.first_head, local.num_heads),
        }
        pieces, offset = [], 0
        for part in parts:
            start, count = mine[part]
            pieces.append(torch.arange(offset + start, offset + start + count))
            offset += widths[part]
        return torch.cat(pieces)

    def checkpoint_part(self, leaf: str, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """This rank's part of the whole checkpoint tensor ``leaf`` of the mixer
        (``in_proj.weight``, ``conv1d.bias``, ``A_log``, ...; ``what`` names it in errors).
        Unchanged for one rank; a ``ValueError`` when a fused tensor's rows do not match the
        config (rather than cutting the wrong rows)."""
        if self.size == 1:
            return tensor
        module = leaf.split(".")[0]
        full, local = self.full, self.local
        if module in ("in_proj", "conv1d"):
            parts = ("z", "x", "B", "C", "dt") if module == "in_proj" else ("x", "B", "C")
            rows = self._rows(parts)
            expected = full.conv_dim + (full.intermediate_size + full.num_heads) * (
                module == "in_proj"
            )
            if tensor.shape[0] != expected:
                raise ValueError(
                    f"checkpoint tensor {what!r} has {tensor.shape[0]} rows, expected "
                    f"{expected} (does config.json match the weights?)"
                )
            return tensor.index_select(0, rows)
        if module in ("dt_bias", "A_log", "D"):
            return tensor[self.first_head : self.first_head + local.num_heads]
        if module == "norm":
            channel = self.first_head * full.head_dim
            return tensor[channel : channel + local.intermediate_size]
        if leaf == "out_proj.bias":  # added once, after the sum over the ranks
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if leaf == "out_proj.weight":
            channel = self.first_head * full.head_dim
            return tensor[:, channel : channel + local.intermediate_size]
        return tensor


def mamba2_shard(spec: Mamba2Spec, size: int, rank: int) -> Mamba2Shard:
    """Rank ``rank`` of ``size``'s :class:`Mamba2Shard` of ``spec``; a ``ValueError`` when
    the heads do not split evenly or the groups neither split evenly nor fit a whole number of
    times into the ranks."""
    heads, groups = spec.num_heads, spec.n_groups
    if heads % size:
        raise ValueError(
            f"the Mamba2 mixer's heads ({heads}) are not divisible by --tensor-parallel-size {size}"
        )
    local_heads = heads // size
    if groups % size == 0:
        local_groups, first_group, ranks_per_group = groups // size, rank * groups // size, 1
    elif size % groups == 0:
        ranks_per_group = size // groups
        local_groups, first_group = 1, rank // ranks_per_group
    else:
        raise ValueError(
            f"the Mamba2 mixer's n_groups ({groups}) and --tensor-parallel-size {size} do not "
            "fit: one must divide the other (groups are split evenly over the ranks, or each "
            "rank keeps a copy of its heads' group)"
        )
    local = dataclasses.replace(
        spec,
        num_heads=local_heads,
        n_groups=local_groups,
        intermediate_size=local_heads * spec.head_dim,
    )
    return Mamba2Shard(
        full=spec,
        local=local,
        size=size,
        rank=rank,
        first_head=rank * local_heads,
        first_group=first_group,
        ranks_per_group=ranks_per_group,
    )
