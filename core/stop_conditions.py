"""Token-level stop conditions, shared by every scheduler (built-in or third-party).

Stop *strings* need text and are applied by the front-end's output processor; everything that
only needs token ids is decided here, in the engine core, so finished requests free their KV
blocks at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from chassis.core.request import FinishReason

if TYPE_CHECKING:
    from chassis.core.request import Request


def check_stop(request: Request, max_model_len: int | None) -> bool:
    """Decide whether ``request`` is finished after a token was appended to its outputs.

    Sets ``request.finish_reason`` (and ``request.stop_reason``) and returns ``True`` when:

    * the last token is one of ``request.eos_token_ids`` and not ``ignore_eos``
      (``STOP``, ``stop_reason`` stays ``None``);
    * the last token is in ``sampling_params.stop_token_ids`` (``STOP``, ``stop_reason`` is
      that id);
    * ``max_tokens`` outputs exist, or ``request.num_tokens >= max_model_len`` (``LENGTH``).

    EOS and stop tokens count only once at least ``min_tokens`` outputs exist; they are checked
    before the length limits, so a stop token that is also the last allowed token reports
    ``STOP``. ``max_model_len=None`` means no context limit. Does not change the status or free
    anything: that is the scheduler's job.
    """
    params = request.sampling_params
    num_outputs = len(request.output_token_ids)
    if num_outputs == 0:
        return False
    if num_outputs >= params.min_tokens:
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last in request.eos_token_ids:
            request.finish_reason = FinishReason.STOP
            request.stop_reason = None
            return True
        if last in params.stop_token_ids:
            request.finish_reason = FinishReason.STOP
            request.stop_reason = last
            return True
    if (params.max_tokens is not None and num_outputs >= params.max_tokens) or (
        max_model_len is not None and request.num_tokens >= max_model_len
    ):
        request.finish_reason = FinishReason.LENGTH
        return True
    return False
