"""``--torch-compile``: the model's forward through ``torch.compile``, attention left opaque.

The forward of a whole step becomes one graph: the model is traced with the number of tokens
dynamic, and each attention layer is a single custom op, ``chassis::paged_attention``, whose
body (the attention backend: KV write, paged attention, host-side metadata) runs eagerly. The
op reads the step's :class:`~chassis.core.attention.ForwardContext` from a slot that
:class:`CompiledForward` fills around each call, so no per-step Python value (lengths, block
tables) reaches the traced code, and nothing recompiles from step to step: one graph for any
number of tokens, plus the one torch specializes for a single token.

While tracing (``torch.compiler.is_compiling()``) the layers take their torch reference paths,
not the platform's fused kernels: inductor fuses those chains itself. For the same reason the
worker skips the platform's ``prepare_model`` (weight packing for its own kernels) when
compiling.

Device graphs compose with it: :class:`~chassis.core.cuda_graphs.DecodeGraphs` captures the
compiled forward like the eager one.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from chassis.core.attention import ForwardContext
    from chassis.core.layers.attention import Attention
    from chassis.core.model_interface import CausalLM

logger = logging.getLogger(__name__)

#: the step being run through a compiled forward: its context and the model's attention layers
_current: tuple[ForwardContext, dict[int, Attention]] | None = None


@torch.library.custom_op("chassis::paged_attention", mutates_args=())
def paged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int
) -> torch.Tensor:
    """Attention layer ``layer_idx`` of the model :class:`CompiledForward` is running: writes
    the step's K/V into its cache and returns ``[T, H*D]`` (see ``Attention.forward``).

    The KV cache it writes is not an argument: the op sits in the traced graph as a call with
    a data dependency on its inputs and its output, which keeps the layers in order.
    """
    if _current is None:
        raise RuntimeError(
            "chassis::paged_attention runs only inside a CompiledForward call (--torch-compile)"
        )
    ctx, layers = _current
    return layers[layer_idx].run_backend(query, key, value, ctx)


@paged_attention.register_fake
def _paged_attention_fake(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int
) -> torch.Tensor:
    return query.new_empty((query.shape[0], math.prod(query.shape[1:])))


@contextmanager
def _step_context(ctx: ForwardContext, layers: dict[int, Attention]) -> Iterator[None]:
    global _current
    previous, _current = _current, (ctx, layers)
    try:
        yield
    finally:
        _current = previous


class CompiledForward:
    """Calls like the model (``(input_ids, positions, ctx) -> hidden states``), compiled.

    Compilation happens at the first call of each new kind of shape (any token count, and a
    single token); each one is logged with its seconds, and :attr:`compile_seconds` sums them.
    """

    def __init__(self, model: CausalLM) -> None:
        from chassis.core.layers.attention import Attention

        self.model = model
        self.layers = {m.layer_idx: m for m in model.modules() if isinstance(m, Attention)}
        self.compile_seconds = 0.0
        self._compiled = torch.compile(self._forward, dynamic=True, options=_inductor_options())

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # The traced model never reads the context: its attention layers call the op.
        return self.model(input_ids, positions, cast("ForwardContext", _TRACED_CONTEXT))

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        graphs_before = _unique_graphs()
        start = time.perf_counter()
        with _step_context(ctx, self.layers):
            hidden = self._compiled(input_ids, positions)
        new_graphs = _unique_graphs() - graphs_before
        if new_graphs:
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            logger.info(
                "torch.compile: compiled the forward for %d token%s in %.1f s (%d graph%s; "
                "%.1f s of compilation so far)",
                input_ids.shape[0],
                "" if input_ids.shape[0] == 1 else "s",
                seconds,
                new_graphs,
                "" if new_graphs == 1 else "s",
                self.compile_seconds,
            )
        return hidden


class _TracedContext:
    """Stands in for the ForwardContext inside the traced forward; reading it is a bug."""

    def __getattr__(self, name: str) -> None:
        raise AttributeError(
            f"ForwardContext.{name} read inside a compiled forward: under --torch-compile a "
            "model must reach attention only through chassis.core.layers.attention.Attention"
        )


_TRACED_CONTEXT = _TracedContext()


def _inductor_options() -> dict[str, bool]:
    """Round at every cast to a 16-bit dtype, as eager torch (and HF transformers) do, instead of
    keeping fused intermediates in float32, where this torch's inductor can."""
    from torch._inductor import config

    if "emulate_precision_casts" in config.get_config_copy():
        return {"emulate_precision_casts": True}
    return {}


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
