"""The tensor-parallel group of this process: its rank, its size, and the collective the
sharded layers need.

With ``--tensor-parallel-size N`` the engine runs N workers, one process each (rank 0 in the
engine-core process), joined in one ``torch.distributed`` group over the platform's
``dist_backend`` (NCCL on GPUs, gloo on CPUs). A TP-aware model (``CausalLM.supports_tensor_
parallel``) reads :func:`tp_rank` and :func:`tp_size` when it is built, keeps its share of the
attention heads and MLP columns, and sums the partial outputs with :func:`all_reduce`. In a
process that joined no group every call here is the single-device case: rank 0 of size 1.

With ``--pipeline-parallel-size M`` (tensor parallelism 1) the M processes of the group are
pipeline stages instead: :func:`pp_rank` holds a contiguous run of the decoder layers
(``chassis.core.pipeline_parallel``), the hidden states pass stage to stage with
:func:`send_to_next_stage` / :func:`recv_from_previous_stage`, and the last stage's logits
reach every rank by :func:`broadcast_from_last_stage`. :func:`tp_size` is then 1 (nothing is
sharded), :func:`world_size` is M.

With ``--enable-expert-parallel`` the mixture-of-experts layers place whole experts on the
ranks instead (:func:`expert_split`, :func:`shard_experts`, :func:`shard_expert_columns`); everything else stays
tensor-parallel, and the experts' partial outputs are summed by the same all-reduce.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    #: the MoE layers hold whole experts per rank (``--enable-expert-parallel``)
    expert_parallel: bool = False
    #: this process's pipeline stage, and the number of stages (``--pipeline-parallel-size``)
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def world(self) -> int:
        """Every process of the group: tensor ranks times pipeline stages."""
        return self.size * self.pp_size


_GROUP = TensorParallelGroup()


def tp_rank() -> int:
    """This process's rank in its tensor-parallel group (0 without one)."""
    return _GROUP.rank


def tp_size() -> int:
    """The number of processes the model is sharded over (1 without a group)."""
    return _GROUP.size


def pp_rank() -> int:
    """This process's pipeline stage (0 without pipeline parallelism)."""
    return _GROUP.pp_rank


def pp_size() -> int:
    """The number of pipeline stages (1 without pipeline parallelism)."""
    return _GROUP.pp_size


def world_size() -> int:
    """Every process of the group (tensor ranks times pipeline stages; 1 without one)."""
    return _GROUP.world


def init_tensor_parallel(
    rank: int,
    size: int,
    backend: str,
    init_method: str,
    *,
    expert_parallel: bool = False,
    pipeline_size: int = 1,
) -> None:
    """Join the group of ``size`` processes as ``rank`` (every rank calls this at the same
    time; it returns once all have joined). ``init_method`` is a ``torch.distributed``
    rendezvous address, e.g. ``file:///tmp/dir/rendezvous``. All ranks run on this host, so
    the collectives' sockets listen on the loopback interface unless ``GLOO_SOCKET_IFNAME`` /
    ``NCCL_SOCKET_IFNAME`` say otherwise. ``expert_parallel``: the MoE layers built
    afterwards hold whole experts per rank (meaningless, and ignored, for ``size`` 1).
    ``pipeline_size`` above 1: the group's ``size * pipeline_size`` processes are pipeline
    stages, ``rank`` being the stage (only with ``size`` 1: the engine refuses both at once)."""
    global _GROUP
    if pipeline_size > 1 and size != 1:
        raise ValueError("pipeline parallelism with tensor parallelism is not supported")
    world = size * pipeline_size
    if world > 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        torch.distributed.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            # Long: a rank may load its weights minutes after another. A rank that fails
            # exits, which fails the others' collectives at once.
            timeout=datetime.timedelta(minutes=30),
        )
    if pipeline_size > 1:
        _GROUP = TensorParallelGroup(0, 1, False, pp_rank=rank, pp_size=pipeline_size)
    else:
        _GROUP = TensorParallelGroup(rank, size, expert_parallel and size > 1)


def destroy_tensor_parallel() -> None:
    """Leave the group (a no-op without one)."""
    global _GROUP
    try:
        if _GROUP.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    finally:
        _GROUP = TensorParallelGroup()


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over the group, in place; every rank gets the same values."""
    if _GROUP.size > 1:
        torch.distributed.all_reduce(tensor)
    return tensor


def broadcast_from_driver(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``tensor`` on every rank (a new contiguous tensor; unchanged without a
    group). Every process of the group takes part (pipeline stages too)."""
    if _GROUP.world == 1:
        return tensor
    tensor = tensor.contiguous()
    torch.distributed.broadcast(tensor, src=0)
    return tensor


def send_to_next_stage(tensor: torch.Tensor) -> None:
    """Send ``tensor`` to the next pipeline stage (which calls
    :func:`recv_from_previous_stage` with its shape and dtype)."""
    torch.distributed.send(tensor.contiguous(), dst=_GROUP.pp_rank + 1)


def recv_from_previous_stage(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The tensor the previous pipeline stage sent (:func:`send_to_next_stage`)."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    torch.distributed.recv(tensor, src=_GROUP.pp_rank - 1)
    return tensor


def broadcast_from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's ``tensor`` on every stage (the others pass a tensor of the
    same shape and dtype to receive into); unchanged without pipeline parallelism."""
    if _GROUP.pp_size == 1:
        return tensor
    tensor = tensor.contiguous()
    torch.distributed.broadcast(tensor, src=_GROUP.pp_size - 1)
    return tensor


def shard(size: int, what: str) -> tuple[int, int]:
    """This rank's ``(start, length)`` of ``size`` items split evenly over the group; a
    ``ValueError`` naming ``what`` when ``size`` does not divide evenly."""
    if size % _GROUP.size:
        raise ValueError(
            f"{what} ({size}) is not divisible by --tensor-parallel-size {_GROUP.size}"
        )
    length = size // _GROUP.size
    return _GROUP.rank * length, length


def kv_head_split(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s ``(first KV head, number of KV heads)`` out of ``num_kv_heads`` over
    a group of ``size``.

    An even split when ``size`` divides ``num_kv_heads``. With fewer KV heads than ranks,
    when ``num_kv_heads`` divides ``size``, each rank holds one head, replicated: rank ``r``
    holds head ``r // (size / num_kv_heads)``, the one its query heads (an even share) read
    in grouped-query attention. Anything else is a ``ValueError``.
    """
    if num_kv_heads % size == 0:
        per_rank = num_kv_heads // size
        return rank * per_rank, per_rank
    if size % num_kv_heads == 0:
        return rank // (size // num_kv_heads), 1
    raise ValueError(
        f"num_key_value_heads ({num_kv_heads}) and --tensor-parallel-size {size} do not fit: "
        "one must divide the other (KV heads are split evenly over the ranks, or replicated "
        "when there are fewer of them than ranks)"
    )


def shard_kv_heads(num_kv_heads: int) -> tuple[int, int]:
    """This rank's ``(first KV head, number of KV heads)``: :func:`kv_head_split` in this
    process's group."""
    return kv_head_split(num_kv_heads, _GROUP.size, _GROUP.rank)


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor``, concatenated along the last dimension in rank order (the
    same on every rank; ``tensor`` itself without a group)."""
    if _GROUP.size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(_GROUP.size)]
    torch.distributed.all_gather(parts, tensor)
    return torch.cat(parts, dim=-1)


def expert_parallel() -> bool:
    """Whether this rank's MoE layers hold whole experts (``--enable-expert-parallel`` with
    more than one rank) rather than a share of every expert's columns."""
    return _GROUP.expert_parallel


def expert_split(num_experts: int, size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s ``(first expert, number of experts)`` of ``num_experts`` placed over
    ``size`` ranks in contiguous ranges, as vLLM's default (linear) placement: each rank gets
    ``num_experts // size`` experts and the first ``num_experts % size`` ranks one more. A
    rank may get none when there are fewer experts than ranks."""
    if num_experts < 0 or not 0 <= rank < size:
        raise ValueError(f"no expert split of {num_experts} experts for rank {rank} of {size}")
    base, extra = divmod(num_experts, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def shard_experts(num_experts: int) -> tuple[int, int]:
    """This rank's ``(first expert, number of experts)``: :func:`expert_split` under expert
    parallelism, else every expert (``(0, num_experts)``)."""
    if not _GROUP.expert_parallel:
        return 0, num_experts
    return expert_split(num_experts, _GROUP.size, _GROUP.rank)


def shard_expert_columns(intermediate_size: int, what: str) -> tuple[int, int]:
    """This rank's ``(start, length)`` of each held expert's ``intermediate_size`` columns:
    all of them under expert parallelism (the rank holds whole experts), else :func:`shard`'s
    share (``what`` names the config field in its error)."""
    if _GROUP.expert_parallel:
        return 0, intermediate_size
    return shard(intermediate_size, what)
