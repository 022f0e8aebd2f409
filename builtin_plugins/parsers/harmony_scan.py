"""Reading OpenAI's Harmony format (gpt-oss) as it streams: the messages of an assistant turn,
for the ``openai_gptoss`` reasoning parser and the ``openai`` tool parser.

An assistant turn is a run of messages, each a header and a body::

    <|start|>assistant<|channel|>analysis<|message|>...chain of thought...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

(without the line breaks). The header names the role, the ``<|channel|>`` (``analysis``,
``commentary``, ``final``), the recipient (``to=functions.NAME``, before or after the channel)
and the content type (``<|constrain|>json``, or a bare ``json``); the body runs from
``<|message|>`` to ``<|end|>``, ``<|return|>`` or ``<|call|>`` (the last two are stop tokens
the engine usually leaves out of the text). The chat template ends the prompt with
``<|start|>assistant``, so the output starts inside the first header (``<|channel|>...``).

:class:`HarmonyScanner` turns text fed in pieces into :class:`Open`, :class:`Text` and
:class:`Close` events, the same events whatever the pieces (text that may be the start of a
marker is held until the next piece tells). Leniency, so that nothing visible is lost:

- output that does not start with a header (no ``<|channel|>``, ``<|start|>``,
  ``<|message|>``, ``<|constrain|>`` or ``to=`` first) is *plain* text, outside any message,
  and so is text between messages; a ``<|start|>`` or ``<|channel|>`` there opens a message;
- a ``<|start|>`` or ``<|channel|>`` inside a body ends the message (a forgotten ``<|end|>``)
  and opens the next; a terminator inside a header drops the header;
- a header or a body cut short by the end of the output: the header is dropped (it is
  markup, not text), the body ends there (:class:`Close` with no terminator).
"""

from __future__ import annotations

from dataclasses import dataclass

from chassis.builtin_plugins.parsers.tagged_blocks import first_marker, partial_marker_len

START = "<|start|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
#: the tokens that end a message's body
TERMINATORS = (END, RETURN, CALL)
#: what ends a run of text (a body, or plain text): a terminator or a new header
_TEXT_MARKERS = (START, CHANNEL, *TERMINATORS)
#: what ends a header: its body's start, a new header, or (malformed) a terminator
_HEADER_MARKERS = (MESSAGE, START, *TERMINATORS)
#: what the output starts with when it starts in a header (after the prompt's
#: ``<|start|>assistant``)
_OPENERS = (START, CHANNEL, MESSAGE, CONSTRAIN, "to=", " to=")

#: the functions namespace of the recipients of function calls
FUNCTIONS = "functions."


@dataclass(frozen=True)
class Header:
    """A message's header. ``text`` is as written, from after ``<|start|>`` (when
    ``started``) up to and including ``<|message|>``; the other fields are read from it
    (``None`` when absent)."""

    text: str
    started: bool
    role: str | None = None
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    @property
    def opening(self) -> str:
        """The message's opening as a whole Harmony message starts: with ``<|start|>`` and a
        role (``assistant`` when the header began in the prompt)."""
        if self.started:
            return START + self.text
        return START + "assistant" + self.text

    @property
    def function(self) -> str | None:
        """The function a ``to=functions.NAME`` message calls (``None``: not a call)."""
        recipient = self.recipient or ""
        if recipient.startswith(FUNCTIONS) and len(recipient) > len(FUNCTIONS):
            return recipient[len(FUNCTIONS) :]
        return None

    @property
    def kind(self) -> str:
        """What the message is: ``"call"`` (to a function), ``"reasoning"`` (the
        ``analysis`` channel, built-in tool calls there included), ``"addressed"`` (another
        recipient, outside ``analysis``), or ``"content"`` (``final``, recipient-less
        ``commentary``, i.e. a preamble, and any other channel or none)."""
        if self.function is not None:
            return "call"
        if self.channel == "analysis":
            return "reasoning"
        if self.recipient:
            return "addressed"
        return "content"


def parse_header(text: str, started: bool) -> Header:
    """The :class:`Header` written as ``text`` (see :class:`Header`)."""
    body = text[: -len(MESSAGE)] if text.endswith(MESSAGE) else text
    words = body.replace(CHANNEL, f" {CHANNEL} ").replace(CONSTRAIN, f" {CONSTRAIN} ").split()
    role = channel = recipient = content_type = None
    expect = None  # the word a marker announced: "channel" or "type"
    seen_channel = False
    for word in words:
        if word == CHANNEL:
            expect, seen_channel = "channel", True
        elif word == CONSTRAIN:
            expect = "type"
        elif word.startswith("to="):
            recipient, expect = word[3:] or None, None
        else:
            if expect == "channel":
                channel = word
            elif expect == "type":
                content_type = word
            elif not seen_channel and role is None:
                role = word
            elif content_type is None:  # "commentary json": the type without a marker
                content_type = word
            expect = None
    return Header(text, started, role, channel, recipient, content_type)


def open_message(prompt: str) -> Header | None:
    """The header of the message ``prompt`` leaves open at its body (a template that ends
    with ``<|channel|>final<|message|>``, say), or ``None``."""
    at = prompt.rfind(START)
    if at < 0:
        return None
    tail = prompt[at + len(START) :]
    body_at = tail.find(MESSAGE)
    if body_at < 0 or any(marker in tail for marker in TERMINATORS):
        return None
    return parse_header(tail[: body_at + len(MESSAGE)], started=True)


@dataclass(frozen=True)
class Open:
    """A message's body starts."""

    header: Header


@dataclass(frozen=True)
class Text:
    """Text of the open message's body, or plain text when no message is open."""

    text: str


@dataclass(frozen=True)
class Close:
    """The open message ended: at ``terminator`` as written, or ``""`` (a new header, or
    the end of the output: ``at_end``)."""

    terminator: str
    at_end: bool = False

    @property
    def closing(self) -> str:
        """The message's end as a whole Harmony message ends: the terminator written, or
        ``<|end|>`` when a new header cut the message short (nothing at the output's end)."""
        return self.terminator or ("" if self.at_end else END)


Event = Open | Text | Close

_FIRST = "first"  # the start of the output: a header or plain text
_HEADER = "header"
_BODY = "body"
_PLAIN = "plain"


class HarmonyScanner:
    """Events (:data:`Event`) of Harmony text fed in pieces; see the module docstring.

    ``open_header``: the output starts in that message's body (the prompt opened it, see
    :func:`open_message`); otherwise it starts in a header or as plain text."""

    def __init__(self, open_header: Header | None = None) -> None:
        self._held = ""
        self._state = _FIRST
        #: the open header's text began with ``<|start|>``
        self._started = False
        self._pending: list[Event] = []
        if open_header is not None:
            self._state = _BODY
            self._pending.append(Open(open_header))

    def feed(self, text: str) -> list[Event]:
        """The events ``text``, the next piece, completes."""
        self._held += text
        events, self._pending = self._pending, []
        while self._step(events, final=False):
            pass
        return events

    def finish(self) -> list[Event]:
        """The events of what is still held: the output ended. Call once, last."""
        events, self._pending = self._pending, []
        while self._step(events, final=True):
            pass
        held, self._held = self._held, ""
        if self._state in (_FIRST, _PLAIN) and held:
            events.append(Text(held))
        elif self._state == _BODY:
            if held:
                events.append(Text(held))
            events.append(Close("", at_end=True))
        # _HEADER: a header cut short is markup, dropped
        return events

    def _step(self, events: list[Event], final: bool) -> bool:
        """Advance over the held text; whether to go on."""
        if self._state == _FIRST:
            return self._first(final)
        if self._state == _HEADER:
            return self._header(events)
        return self._text(events, final)

    def _first(self, final: bool) -> bool:
        held = self._held
        opener = next((o for o in _OPENERS if held.startswith(o)), None)
        if opener == START:
            self._held, self._state, self._started = held[len(START) :], _HEADER, True
            return True
        if opener is not None:
            self._state, self._started = _HEADER, False
            return True
        if not final and any(o.startswith(held) for o in _OPENERS):
            return False  # nothing yet, or what may still be an opener
        self._state = _PLAIN
        return not final

    def _header(self, events: list[Event]) -> bool:
        found = first_marker(self._held, _HEADER_MARKERS)
        if found is None:
            return False  # the header is short: held whole until its end
        at, marker = found
        if marker == MESSAGE:
            text = self._held[: at + len(MESSAGE)]
            events.append(Open(parse_header(text, self._started)))
            self._held, self._state = self._held[at + len(MESSAGE) :], _BODY
        elif marker == START:  # a new header: this one had no body
            self._held, self._started = self._held[at + len(START) :], True
        else:  # a terminator in a header: the header is dropped
            self._held, self._state = self._held[at + len(marker) :], _PLAIN
        return True

    def _text(self, events: list[Event], final: bool) -> bool:
        """A body or plain text, up to a terminator or a new header."""
        found = first_marker(self._held, _TEXT_MARKERS)
        if found is None:
            keep = 0 if final else partial_marker_len(self._held, _TEXT_MARKERS)
            ready = self._held[: len(self._held) - keep]
            if ready:
                events.append(Text(ready))
            self._held = self._held[len(ready) :]
            return False
        at, marker = found
        if at:
            events.append(Text(self._held[:at]))
        in_body = self._state == _BODY
        if marker in TERMINATORS:
            if in_body:
                events.append(Close(marker))
            # in plain text a terminator ends nothing that was opened: dropped
            self._held, self._state = self._held[at + len(marker) :], _PLAIN
            return True
        if in_body:
            events.append(Close(""))
        if marker == START:
            self._held, self._started = self._held[at + len(START) :], True
        else:  # <|channel|>: a header without its <|start|>
            self._held, self._started = self._held[at:], False
        self._state = _HEADER
        return True
