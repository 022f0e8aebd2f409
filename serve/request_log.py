"""``--enable-log-requests``: one INFO line per generation request, as vLLM's request logger.

Each engine request that a route starts (completions: one per prompt, ids ``{id}-{i}`` for
a batch; chat and responses: one) is logged before it is submitted::

    Received request cmpl-...: prompt: 'Hello', params: SamplingParams(...),
    prompt_token_ids: [1, 9906], lora_request: None.

With ``--enable-log-outputs`` too, each completion is logged once it ends (one line per
completion of the request, ``n`` above 1 included)::

    Generated response cmpl-...: output: ' Paris.', output_token_ids: [7042, 30],
    finish_reason: stop.

``--max-log-len N`` keeps the first ``N`` characters of the prompt (and of an output) and its
first ``N`` token ids, as vLLM does. A prompt sent as token ids (and every chat prompt, which the server
renders to ids) is logged as its decoded text when the server has a tokenizer. Off by
default: prompts may hold what an operator should not keep in logs.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chassis.core.lora.request import LoRARequest
    from chassis.core.outputs import RequestOutput
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


class OutputLog:
    """The generated text and token ids of one request's completions, gathered from its
    streamed (delta) outputs; each completion is logged when it finishes."""

    def __init__(self, request_id: str, max_log_len: int | None) -> None:
        self.request_id = request_id
        self.max_log_len = max_log_len
        self._texts: dict[int, list[str]] = defaultdict(list)
        self._ids: dict[int, list[int]] = defaultdict(list)

    def observe(self, output: RequestOutput) -> None:
        for completion in output.outputs:
            self._texts[completion.index].append(completion.text)
            self._ids[completion.index].extend(completion.token_ids)
            if completion.finish_reason is not None:
                self._log(completion.index, completion.finish_reason)

    def _log(self, index: int, finish_reason: str) -> None:
        text, ids = "".join(self._texts.pop(index, [])), self._ids.pop(index, [])
        if self.max_log_len is not None:
            text, ids = text[: self.max_log_len], ids[: self.max_log_len]
        logger.info(
            "Generated response %s: output: %r, output_token_ids: %s, finish_reason: %s.",
            self.request_id if index == 0 else f"{self.request_id} (choice {index})",
            text,
            ids,
            finish_reason,
        )


def output_log(settings: ServerSettings, request_id: str) -> OutputLog | None:
    """An :class:`OutputLog` for the request when ``--enable-log-outputs`` (with
    ``--enable-log-requests``) is on and INFO is logged, else ``None``."""
    if not (settings.enable_log_requests and settings.enable_log_outputs):
        return None
    if not logger.isEnabledFor(logging.INFO):
        return None
    return OutputLog(request_id, settings.max_log_len)
