"""The server-sent events of a streamed ``/v1/responses`` request, as OpenAI sends them and
the ``openai`` SDK (``responses.create(stream=True)``, ``responses.stream(...)``) parses them.

Each event is ``event: {type}`` plus ``data: {json}`` whose JSON has ``type`` and an
increasing ``sequence_number``; there is no ``[DONE]``. The order::

    response.created, response.in_progress              (the response, status in_progress;
                                                         a background one is created queued,
                                                         then response.queued)
    per output item, in order:
      response.output_item.added                        (the item, status in_progress)
      message:   response.content_part.added, response.output_text.delta ...,
                 response.output_text.done, response.content_part.done
      reasoning: response.content_part.added, response.reasoning_text.delta ...,
                 response.reasoning_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta ...,
                 response.function_call_arguments.done
      response.output_item.done                         (the whole item)
    response.completed | response.incomplete            (the whole response, with usage)

An item is closed when the next one opens (and the last at the end). Content that is only
whitespace is held back until more text shows it starts a message, so the items match the
non-streamed response's (:mod:`chassis.serve.responses_output`). A failure after the first
event ends the stream with ``error`` and ``response.failed``.

Each ``response.output_text.delta`` carries the ``logprobs`` of its text's tokens, each
token routed on its own also when one engine output holds several (``[]`` unless the
request asked for them; :mod:`chassis.serve.responses_logprobs`), and
``response.output_text.done``, the part and the item all of them. A token with no text of
its own after the message's text (such as the end-of-sequence token) comes in a delta whose
``delta`` is ``""``, so the deltas' logprobs add up to the part's.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from chassis.serve.responses_output import item_status, new_id
from chassis.serve.responses_protocol import (
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from chassis.serve.chat_parsing import ChoiceDelta
    from chassis.serve.protocol import ChatLogprobToken


class ResponseEvents:
    """Turns a message's parsed deltas into the events of one streamed response.

    ``response`` is the response in progress (its echo fields set, no output); the items
    made while streaming are :attr:`items`, the output of the final response.
    """

    def __init__(self, response: ResponseObject) -> None:
        self._response = response
        self._sequence = 0
        self.items: list[OutputItem] = []
        #: the item still open (receiving deltas), if any
        self._open: OutputItem | None = None
        #: whitespace content not yet known to start a message, and its tokens' logprobs
        self._pending = ""
        self._pending_logprobs: list[ChatLogprobToken] = []
        #: the tool parser's call index -> the call's output index
        self._calls: dict[int, int] = {}
        #: the response of :meth:`failed`, once it was called
        self.failed_response: ResponseObject | None = None

    def event(self, kind: str, **fields: Any) -> str:
        """One SSE event of type ``kind``."""
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def start(self) -> list[str]:
        """``response.created`` and ``response.in_progress``."""
        return [self.created(), self.in_progress()]

    def created(self, status: str = "in_progress") -> str:
        """``response.created`` (the response with ``status``)."""
        return self._lifecycle("response.created", status)

    def queued(self) -> str:
        """``response.queued``: a background response waits for the engine."""
        return self._lifecycle("response.queued", "queued")

    def in_progress(self) -> str:
        """``response.in_progress``."""
        return self._lifecycle("response.in_progress", "in_progress")

    def _lifecycle(self, kind: str, status: str) -> str:
        response = self._response.model_copy(update={"status": status})
        return self.event(kind, response=response.model_dump(mode="json"))

    @property
    def has_output(self) -> bool:
        """Whether any output was fed: an item, or content held back as whitespace."""
        return bool(self.items or self._pending)

    def feed(self, delta: ChoiceDelta, logprobs: Sequence[ChatLogprobToken] = ()) -> list[str]:
        """The events of the next parsed piece of the message (``logprobs``: those of its
        content's tokens)."""
        events: list[str] = []
        if delta.reasoning:
            if not isinstance(self._open, ReasoningItem):
                events += self._open_item(ReasoningItem(id=new_id("rs"), status="in_progress"))
            events += self._add_text(delta.reasoning)
        if delta.content:
            if isinstance(self._open, OutputMessage):
                events += self._add_text(delta.content, logprobs)
            else:
                self._pending += delta.content
                self._pending_logprobs += logprobs
                if self._pending.strip():
                    events += self._open_item(OutputMessage(id=new_id("msg"), status="in_progress"))
                    events += self._add_text(self._pending, self._pending_logprobs)
                    self._pending = ""
                    self._pending_logprobs = []
        for fragment in delta.fragments:
            if fragment.starts_call:
                assert fragment.name is not None and fragment.id is not None
                call = FunctionCallItem(
                    id=new_id("fc"), call_id=fragment.id, name=fragment.name, status="in_progress"
                )
                events += self._open_item(call)
                self._calls[fragment.index] = len(self.items) - 1
            if fragment.arguments:
                events += self._add_arguments(self._calls[fragment.index], fragment.arguments)
        return events

    def add_logprobs(self, logprobs: Sequence[ChatLogprobToken]) -> list[str]:
        """The event of logprobs of tokens without text after the message's text: a delta
        of ``""`` on the open message (with held-back content: kept with it; after another
        item: none)."""
        if isinstance(self._open, OutputMessage):
            return self._add_text("", logprobs)
        if self._pending:
            self._pending_logprobs += logprobs
        return []

    def finish(self, status: str) -> list[str]:
        """Close the open item (its status from the response's ``status``); a message of the
        held-back content (maybe empty) when there are no items at all."""
        events: list[str] = []
        if not self.items:
            events += self._open_item(OutputMessage(id=new_id("msg"), status="in_progress"))
            events += self._add_text(self._pending, self._pending_logprobs)
        if self._open is not None:
            events += self._close(item_status(status))
        return events

    def end(self, response: ResponseObject) -> str:
        """The last event: ``response.completed``, or ``response.incomplete`` for a response
        that did not complete."""
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        return self.event(kind, response=response.model_dump(mode="json"))

    def failed(
        self,
        message: str,
        code: str | int | None,
        param: str | None,
        response_code: str = "server_error",
    ) -> list[str]:
        """``error`` (the error's ``message``, ``code`` and ``param``) then
        ``response.failed`` (the items made so far, and the error: ``response_code``, one of
        OpenAI's response error codes, and ``message``)."""
        response = self._response.model_copy(
            update={
                "status": "failed",
                "output": list(self.items),
                "error": {"code": response_code, "message": message},
            }
        )
        self.failed_response = response
        return [
            self.event(
                "error", code=None if code is None else str(code), message=message, param=param
            ),
            self.event("response.failed", response=response.model_dump(mode="json")),
        ]

    # -- items ----------------------------------------------------------------------------------

    def _open_item(self, item: OutputItem) -> list[str]:
        events = self._close("completed") if self._open is not None else []
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        events.append(
            self.event("response.output_item.added", output_index=index, item=item.model_dump())
        )
        if isinstance(item, OutputMessage | ReasoningItem):
            part = OutputText() if isinstance(item, OutputMessage) else ReasoningText()
            item.content.append(part)  # type: ignore[arg-type]
            events.append(self._part_event("response.content_part.added", item, index))
        return events

    def _part_event(self, kind: str, item: OutputMessage | ReasoningItem, index: int) -> str:
        return self.event(
            kind,
            item_id=item.id,
            output_index=index,
            content_index=0,
            part=item.content[0].model_dump(),
        )

    def _add_text(self, text: str, logprobs: Sequence[ChatLogprobToken] = ()) -> list[str]:
        item = self._open
        assert isinstance(item, OutputMessage | ReasoningItem)
        if isinstance(item, ReasoningItem):
            logprobs = ()  # OpenAI gives logprobs for output_text only
        if not text and not logprobs:
            return []
        index = len(self.items) - 1
        if isinstance(item, ReasoningItem):
            item.content[0].text += text
            kind, extra = "response.reasoning_text.delta", {}
        else:
            part = item.content[0]
            part.text += text
            part.logprobs += logprobs
            kind = "response.output_text.delta"
            extra = {"logprobs": [entry.model_dump() for entry in logprobs]}
        return [
            self.event(
                kind, item_id=item.id, output_index=index, content_index=0, delta=text, **extra
            )
        ]

    def _add_arguments(self, index: int, arguments: str) -> list[str]:
        item = self.items[index]
        assert isinstance(item, FunctionCallItem)
        item.arguments += arguments
        return [
            self.event(
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=index,
                delta=arguments,
            )
        ]

    def _close(self, status: str) -> list[str]:
        item = self._open
        assert item is not None
        self._open = None
        index = self.items.index(item)
        events = []
        if isinstance(item, FunctionCallItem):
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    arguments=item.arguments,
                )
            )
        else:
            text = item.content[0].text
            if isinstance(item, ReasoningItem):
                kind, extra = "response.reasoning_text.done", {}
            else:
                logprobs = [entry.model_dump() for entry in item.content[0].logprobs]
                kind, extra = "response.output_text.done", {"logprobs": logprobs}
            fields = {"item_id": item.id, "output_index": index, "content_index": 0}
            events.append(self.event(kind, text=text, **fields, **extra))
            events.append(self._part_event("response.content_part.done", item, index))
        item.status = status  # type: ignore[assignment]
        events.append(
            self.event("response.output_item.done", output_index=index, item=item.model_dump())
        )
        return events
