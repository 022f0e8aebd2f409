"""The forward of a multimodal model whose decoder reads prompt rows given as embeddings."""

from __future__ import annotations

import inspect

import torch

from chassis.core.attention import ForwardContext


class DecoderOverEmbeds:
    """Mixin, listed before the text-only class it extends (a ``CausalLM`` whose decoder
    ``self.model`` has ``embed(input_ids)`` and takes ``inputs_embeds=``), for a model that
    takes images or audio: text steps run the text-only forward unchanged; a step with
    ``inputs_embeds`` (:meth:`embed_input_ids`' rows, the items' rows spliced in) runs the
    decoder over those rows instead."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder's forward; with ``inputs_embeds``, the decoder over those."""
        if inputs_embeds is None:
            return super().forward(input_ids, positions, ctx)  # type: ignore[misc]
        return self.model(input_ids, positions, ctx, inputs_embeds=inputs_embeds)  # type: ignore[attr-defined]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's token embeddings of ``input_ids`` (what its first layer reads)."""
        return self.model.embed(input_ids)  # type: ignore[attr-defined]

    def check_decoder_takes_embeds(self, what_needs: str) -> None:
        """``ValueError`` (``"<class>: <what_needs> a text decoder ..."``) when the decoder's
        forward takes no ``inputs_embeds``: a decoder built for text only, which cannot run
        over spliced rows."""
        decoder = self.model  # type: ignore[attr-defined]
        decoder_forward = getattr(decoder, "forward", None)
        if (
            decoder_forward is None
            or "inputs_embeds" not in inspect.signature(decoder_forward).parameters
        ):
            raise ValueError(
                f"{type(self).__name__}: {what_needs} a text decoder whose forward takes "
                f"input embeddings, and {type(decoder).__name__}'s does not"
            )
