"""``GET /v1/responses/{id}/input_items``: a stored response's input items as OpenAI lists
them, a page at a time.

The input items of a response are the items the model was given: those of the turns before it
(through ``previous_response_id``: their input items and output items) and then its own
``input``, in conversation order; ``instructions`` are not an item. Every item carries an
``id``: the one the client sent, else one given when the response was stored (so the same
item keeps its id in the listing of every later turn). A listed item has OpenAI's listing
shape: ``status: completed``, and a message's string content as one text part
(``input_text``, or ``output_text`` for an assistant message); an ``input_image`` part is
listed as it was sent (its ``image_url`` as given), with ``detail: "auto"`` when it had none.

Pages follow OpenAI's cursor rules: ``order`` (``desc``, the default: newest first, or
``asc``), ``after`` / ``before`` (an item id: the items after or before it in that order),
``limit`` (1 to 100, default 20), and ``has_more`` when items beyond the page remain in that
direction.
"""

from __future__ import annotations

from typing import Any, Literal

from chassis.serve.errors import bad_request
from chassis.serve.responses_output import new_id

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
_ID_PREFIX = {"function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``items`` with an ``id`` on each (a copy of those that lacked one, given a fresh id
    by kind: ``msg_``, ``fc_``, ``fco_``, ``rs_``)."""
    out = []
    for item in items:
        if isinstance(item.get("id"), str) and item["id"]:
            out.append(item)
        else:
            prefix = _ID_PREFIX.get(item.get("type", "message"), "msg")
            out.append({**item, "id": new_id(prefix)})
    return out


def listed(item: dict[str, Any]) -> dict[str, Any]:
    """One stored item in the shape of OpenAI's listing (see the module docstring)."""
    out = {"type": "message", **item}
    out.setdefault("status", "completed")
    if out["type"] == "message":
        assistant = out.get("role") == "assistant"
        content = out.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts = []
        for part in content or []:
            part = dict(part)
            if part.get("type") == "text":
                part["type"] = "output_text" if assistant else "input_text"
            if part["type"] == "output_text":
                part.setdefault("annotations", [])
            elif part["type"] == "input_image":
                part.setdefault("detail", "auto")  # (OpenAI's listing always has one)
            parts.append(part)
        out["content"] = parts
    elif out["type"] == "reasoning":
        out.setdefault("summary", [])
    return out


def page(
    items: list[dict[str, Any]],
    *,
    after: str | None = None,
    before: str | None = None,
    limit: int = DEFAULT_LIMIT,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    """One page of ``items`` (in conversation order) as OpenAI's list object; 400s naming
    the parameter for a ``limit`` out of range, an unknown ``order`` and an ``after`` /
    ``before`` id that is not one of the items."""
    if not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"limit must be between 1 and {MAX_LIMIT}; got {limit}", "limit")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc'; got {order!r}", "order")
    ordered = list(items) if order == "asc" else list(reversed(items))
    ids = [item.get("id") for item in ordered]
    start, stop = 0, len(ordered)
    for name, cursor in (("after", after), ("before", before)):
        if cursor is None:
            continue
        if cursor not in ids:
            raise bad_request(f"{name}: no input item with id {cursor!r} in this response", name)
        if name == "after":
            start = max(start, ids.index(cursor) + 1)
        else:
            stop = min(stop, ids.index(cursor))
    window = ordered[start:stop]
    if before is not None and after is None:
        # walking backwards: the page is the items just before the cursor
        data, has_more = window[-limit:], len(window) > limit
    else:
        data, has_more = window[:limit], len(window) > limit
    data = [listed(item) for item in data]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
