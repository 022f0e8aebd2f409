"""The attention layer models use: reshapes, then hands off to the selected backend."""

from __future__ import annotations

import torch
from torch import nn

from chassis.core.attention import AttentionBackend, ForwardContext


def check_attend_limit_support(backend_cls: type[AttentionBackend], model_name: str) -> None:
    """A ``ValueError`` naming ``backend_cls`` when it does not honour
    :attr:`~chassis.core.attention.AttentionMetadata.attend_limit`, which ``model_name``'s
    image tokens need (they attend to each other both ways): no silent causal attention."""
    if not backend_cls.supports_attend_limit:
        raise ValueError(
            f"attention backend {backend_cls.__name__} does not support attend_limit "
            f"(bidirectional attention within an image's tokens), which {model_name} needs "
            "for images; choose another with --attention-backend (torch_paged, cpu_paged "
            "and triton_paged support it)"
        )


class Attention(nn.Module):
    """Paged causal attention of one decoder layer.

    Holds no weights. It owns one instance of the engine's attention backend class and reads
    its KV cache from ``ctx.kv_caches[layer_idx]`` at every step.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        layer_idx: int,
        backend_cls: type[AttentionBackend],
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
        attention_chunk_size: int | None = None,
    ) -> None:
        """``sliding_window``, ``attention_chunk_size``, ``logits_soft_cap`` and ``sinks`` (see
        :class:`AttentionBackend`) need a backend that declares support for them; otherwise
        building the layer is a ``ValueError`` naming the backend, rather than attention that
        silently differs from the model's. ``sinks`` is the model's ``[num_heads]``
        parameter (this layer does not register it: the model owns it under its checkpoint
        name); the backend reads it at every call, so it may be filled after construction."""
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        options: dict[str, int | float | torch.Tensor] = {}
        if sliding_window is not None:
            if not backend_cls.supports_sliding_window:
                raise ValueError(
                    f"attention backend {backend_cls.__name__} does not support sliding-window "
                    f"attention, which this model's layer {layer_idx} uses (window "
                    f"{sliding_window}); choose another with --attention-backend"
                )
            options["sliding_window"] = sliding_window
        self.attention_chunk_size = attention_chunk_size
        if attention_chunk_size is not None:
            if not backend_cls.supports_chunked_attention:
                raise ValueError(
                    f"attention backend {backend_cls.__name__} does not support chunked local "
                    f"attention, which this model's layer {layer_idx} uses (chunks of "
                    f"{attention_chunk_size}); choose another with --attention-backend "
                    "(torch_paged, cpu_paged and triton_paged support it)"
                )
            options["attention_chunk_size"] = attention_chunk_size
        if logits_soft_cap is not None:
            if not backend_cls.supports_logits_soft_cap:
                raise ValueError(
                    f"attention backend {backend_cls.__name__} does not support attention "
                    f"logit soft-capping, which this model uses (cap {logits_soft_cap}); "
                    "choose another with --attention-backend"
                )
            options["logits_soft_cap"] = logits_soft_cap
        if sinks is not None:
            if not backend_cls.supports_attention_sinks:
                raise ValueError(
                    f"attention backend {backend_cls.__name__} does not support attention "
                    f"sinks, which this model's layer {layer_idx} uses; choose another with "
                    "--attention-backend (torch_paged, cpu_paged and triton_paged support them)"
                )
            options["sinks"] = sinks
        self.has_sinks = sinks is not None
        self.backend = backend_cls(num_heads, head_dim, num_kv_heads, scale, **options)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """``q [T, H*D]`` (or ``[T, H, D]``), ``k``/``v [T, KV*D]`` -> ``[T, H*D]``.

        Inside ``torch.compile`` (``--torch-compile``) the layer is one opaque op that finds the
        step's context itself (:mod:`chassis.core.compiled_model`).
        """
        if torch.compiler.is_compiling():
            from chassis.core.compiled_model import paged_attention

            return paged_attention(q, k, v, self.layer_idx)
        return self.run_backend(q, k, v, ctx)

    def run_backend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Hand the step's q/k/v to the backend, with this layer's KV cache."""
        num_tokens = q.shape[0]
        out = self.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            ctx.kv_caches[self.layer_idx],
            ctx.metadata_for(self.layer_idx),
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, backend={type(self.backend).__name__}"
            + (f", sliding_window={self.sliding_window}" if self.sliding_window else "")
            + (f", chunk={self.attention_chunk_size}" if self.attention_chunk_size else "")
            + (f", soft_cap={self.logits_soft_cap}" if self.logits_soft_cap else "")
            + (", sinks" if self.has_sinks else "")
        )
