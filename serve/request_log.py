"""``--enable-log-requests``: one INFO line per generation request, as vLLM's request logger.

Each engine request that a route starts (completions: one per prompt, ids ``{id}-{i}`` for
a batch; chat and responses: one) is logged before it is submitted::

    Received request cmpl-...: prompt: 'Hello', params: SamplingParams(...),
    prompt_token_ids: [1, 9906], lora_request: None.

``--max-log-len N`` keeps the first ``N`` characters of the prompt and its first ``N`` token
ids, as vLLM does. A prompt sent as token ids (and every chat prompt, which the server
renders to ids) is logged as its decoded text when the server has a tokenizer. Off by
default: prompts may hold what an operator should not keep in logs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chassis.core.lora.request import LoRARequest
    from chassis.core.sampling_params import SamplingParams
    from chassis.serve.settings import ServerSettings

logger = logging.getLogger(__name__)


def log_request(
    settings: ServerSettings,
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int] | None,
    params: SamplingParams,
    lora_request: LoRARequest | None,
    tokenizer: Any = None,
) -> None:
    """Log one request when ``settings.enable_log_requests`` (a no-op otherwise).

    ``prompt``: the text as the client sent it, or ``None`` to log ``prompt_token_ids``
    decoded with ``tokenizer`` (none: no text). Both are cut to ``settings.max_log_len``.
    """
    if not settings.enable_log_requests or not logger.isEnabledFor(logging.INFO):
        return
    limit = settings.max_log_len
    ids = prompt_token_ids
    if ids is not None and limit is not None:
        ids = ids[:limit]
    if prompt is None and prompt_token_ids is not None and tokenizer is not None:
        # only the ids that can show within the limit are decoded (a long prompt is not
        # decoded whole to log a few characters of it)
        prompt = tokenizer.decode(ids, skip_special_tokens=False)
    if prompt is not None and limit is not None:
        prompt = prompt[:limit]
    logger.info(
        "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s.",
        request_id,
        prompt,
        params,
        ids,
        None if lora_request is None else lora_request.lora_name,
    )
