"""Prompts given as input embeddings (vLLM's ``prompt_embeds``, behind
``--enable-prompt-embeds``).

A caller that computed a prompt's input embeddings itself (the model's own token embeddings,
edited, or a soft prompt) sends the ``[seq_len, hidden_size]`` float tensor instead of text
or token ids: offline ``LLM.generate({"prompt_embeds": tensor})``, served
``/v1/completions`` ``prompt_embeds`` (the base64 of a ``torch.save``'d tensor, or a list
of them). The front-end wraps it in :class:`EmbedsPrompt`, checks it (:func:`check_embeds`)
and sends it to the engine core in ``EngineCoreRequest.prompt_embeds``.

In the engine the request's prompt is ``seq_len`` placeholder tokens
(:data:`PLACEHOLDER_TOKEN_ID`, as vLLM reports them in ``RequestOutput.prompt_token_ids``):
they count for lengths and block allocation, and the runner feeds the given rows instead of
their embeddings (:mod:`chassis.core.prompt_embeds_runner`); generated tokens run on the
model's own embeddings. The placeholders are never read as tokens: repetition penalties see
no prompt tokens for such a request, and the prefix cache keys each block covering prompt
positions by the bytes of its rows (:func:`embeds_block_keys`), so requests share cached
blocks exactly when their leading rows (and dtype) are equal. A preempted request keeps its
embeddings in the scheduler and comes back to the runner with them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from chassis.core.multimodal import MultiModalTensor

#: the token id standing for each prompt position of a request given as embeddings
PLACEHOLDER_TOKEN_ID = 0
#: the flag, as messages name it
FLAG = "--enable-prompt-embeds (enable_prompt_embeds=True offline)"
#: the dtypes taken (vLLM's): the rows are cast to the model's dtype in the runner
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True, eq=False)
class EmbedsPrompt:
    """A prompt given as input embeddings: ``embeds`` ``[seq_len, hidden_size]`` (checked by
    :meth:`InputProcessor.process <chassis.core.input_processor.InputProcessor.process>`)."""

    embeds: Any


def flag_refusal() -> str:
    """The message for prompt embeddings sent to an engine without the flag."""
    return f"prompt embeddings (prompt_embeds) are taken only when the engine runs with {FLAG}"


def check_embeds(embeds: Any, hidden_size: int) -> torch.Tensor:
    """``embeds`` checked and returned detached, contiguous, on the CPU: a ``torch.Tensor``
    of dtype float32, float16 or bfloat16, ``[seq_len, hidden_size]`` (a leading batch
    dimension of 1 is dropped, as vLLM drops it) with ``seq_len >= 1``, every value finite.
    ``ValueError`` naming what is wrong otherwise. The length is checked against
    ``max_model_len`` with the token prompts' rules by the caller."""
    if not isinstance(embeds, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch.Tensor; got {type(embeds).__name__}")
    if embeds.layout != torch.strided:
        raise ValueError("prompt_embeds must be a dense tensor; got a sparse one")
    if embeds.dtype not in DTYPES:
        raise ValueError(
            "prompt_embeds must be float32, float16 or bfloat16; got "
            f"{str(embeds.dtype).removeprefix('torch.')}"
        )
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2 or embeds.shape[1] != hidden_size:
        raise ValueError(
            f"prompt_embeds has shape {tuple(embeds.shape)}; expected [seq_len, {hidden_size}] "
            f"(the model's hidden size {hidden_size})"
        )
    if embeds.shape[0] == 0:
        raise ValueError("prompt_embeds has no rows: the prompt must hold at least one")
    if not bool(torch.isfinite(embeds).all()):
        raise ValueError("prompt_embeds holds non-finite values (inf or nan)")
    return embeds.detach().to("cpu").contiguous()


def load_base64(text: Any) -> torch.Tensor:
    """One served ``prompt_embeds`` item: the base64 of a ``torch.save``'d tensor, loaded
    with ``weights_only=True`` (plain tensors, no code) within the image-embeddings size
    limit; ``ValueError`` otherwise."""
    from chassis.core.multimodal_embeds import load_embeds

    if not isinstance(text, str):
        raise ValueError(
            "prompt_embeds must be a base64 string of a torch.save'd tensor, or a list of "
            f"them; got {type(text).__name__}"
        )
    return load_embeds(text, "prompt")


def embeds_block_keys(embeds: MultiModalTensor, start: int, end: int) -> bytes:
    """The prefix-cache extra key of the block of positions ``start .. end - 1`` of a
    request given as embeddings: a digest of its dtype and of the rows it covers (``b""``
    past the prompt, where the tokens are real)."""
    num_rows = embeds.shape[0]
    if start >= num_rows:
        return b""
    row_bytes = len(embeds.data) // num_rows
    rows = embeds.data[start * row_bytes : min(end, num_rows) * row_bytes]
    digest = hashlib.sha256(embeds.dtype.encode() + b"|")
    digest.update(rows)
    return b"\0pe:" + digest.digest()
