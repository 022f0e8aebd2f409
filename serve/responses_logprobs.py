"""Output logprobs on ``/v1/responses``: which tokens' logprobs an ``output_text`` carries.

With ``include: ["message.output_text.logprobs"]`` the engine computes each generated token's
logprob and its ``top_logprobs`` alternatives, made into entries exactly as the chat route
makes them (:func:`~chassis.serve.openai_chat.chat_logprobs`: ``token``, ``logprob``,
``bytes``, ``top_logprobs``), so a greedy request gives the chat route's values.

OpenAI gives logprobs for ``output_text`` only, so the tokens of the message text carry them
and the others none: the text ``--reasoning-parser`` routes to a reasoning item, the text
``--tool-call-parser`` routes to a ``function_call`` item, and the markup between them
(``<think>``, ``</think>``, ``<tool_call>``...). Without parsers every token is message text
and the message's logprobs are the chat route's. The parsers classify text, not tokens, so
:class:`LogprobRouter` ties them back: the engine's outputs (each one step's text and tokens)
wait until the parsers classify their text; message text takes the outputs whose text it
covers, found in the text of the waiting outputs (the outputs before it were markup or
reasoning, those after it are text still held back); reasoning or call text alone drops the
waiting outputs. A token with no text of its own (a special token the detokenizer skips, a
piece of a multi-byte character) goes with the next output's text, or, right after message
text with nothing waiting (also once held-back message text is released), with that
message text.

An output may hold several tokens (the deltas of a stream whose reader fell behind are
merged into one; a speculative step accepts several tokens), and its text may be partly
markup or reasoning and partly message text. Each token is routed on its own: the output is
split into its tokens' texts (:func:`token_units`, from each entry's ``bytes``, the token's
own text) when they make up the output's text exactly, so a token goes to the message only
when its own text is message text. Where they do not (a token whose text alone is not what
the detokenizer made of it in context, such as half of a multi-byte character), the
output's tokens go together, as one unit, to the message when any of its text is message
text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from chassis.serve.openai_chat import chat_logprobs

if TYPE_CHECKING:
    from chassis.core.outputs import CompletionOutput
    from chassis.serve.chat_parsing import ChoiceDelta
    from chassis.serve.protocol import ChatLogprobToken
    from chassis.serve.state import ServerState


class LogprobRouter:
    """The logprobs of one streamed message's text (see the module docstring).

    ``top_n``: alternatives per token; ``as_ids``: tokens named ``"token_id:ID"``
    (``--return-tokens-as-token-ids``)."""

    def __init__(self, state: ServerState, top_n: int, as_ids: bool) -> None:
        self._state = state
        self._top_n = top_n
        self._as_ids = as_ids
        #: the outputs whose text the parsers have not classified yet: (text, entries)
        self._waiting: list[tuple[str, list[ChatLogprobToken]]] = []
        #: entries of tokens without text, for the next output's text
        self._textless: list[ChatLogprobToken] = []
        #: whether the last classified text was message text
        self._after_message = False

    def add(self, completion: CompletionOutput) -> list[ChatLogprobToken]:
        """Take one engine output (before its text is parsed). Returns the entries that
        belong to the message text already sent (textless tokens right after it, such as
        the end-of-sequence token), else ``[]``."""
        entries = chat_logprobs(self._state, completion, self._top_n, self._as_ids)
        return self.add_entries(completion.text, entries)

    def add_entries(self, text: str, entries: list[ChatLogprobToken]) -> list[ChatLogprobToken]:
        """:meth:`add` of an output whose text is ``text`` and tokens' entries ``entries``
        (each token routed on its own where :func:`token_units` can split the text)."""
        late: list[ChatLogprobToken] = []
        for unit_text, unit_entries in token_units(text, entries):
            late += self._add_unit(unit_text, unit_entries)
        return late

    def _add_unit(self, text: str, entries: list[ChatLogprobToken]) -> list[ChatLogprobToken]:
        if not text:
            if self._after_message and not self._waiting:
                return entries
            self._textless += entries
            return []
        self._waiting.append((text, self._textless + entries))
        self._textless = []
        return []

    def route(self, delta: ChoiceDelta) -> list[ChatLogprobToken]:
        """The entries of ``delta.content`` (the parsed piece of the outputs added so far);
        ``[]`` when it has no message text."""
        if delta.content:
            self._after_message = True
            # reasoning released with the message text comes before it
            taken = self._take(delta.content, len(delta.reasoning))
            if not self._waiting:  # textless tokens after the last output taken follow it
                taken += self._textless
                self._textless = []
            return taken
        if delta.reasoning or delta.fragments:
            self._after_message = False
            self._waiting = []
        return []

    def _take(self, content: str, after: int) -> list[ChatLogprobToken]:
        joined = "".join(text for text, _ in self._waiting)
        start = joined.find(content, after)
        if start < 0:
            start = joined.find(content)
        if start < 0:  # a parser changed the text: every waiting output is the message's
            taken = [entry for _, entries in self._waiting for entry in entries]
            self._waiting = []
            return taken
        end = start + len(content)
        taken: list[ChatLogprobToken] = []
        kept: list[tuple[str, list[ChatLogprobToken]]] = []
        position = 0
        for text, entries in self._waiting:
            first, position = position, position + len(text)
            if position <= start:
                continue  # markup or reasoning before the message text
            if first >= end:
                kept.append((text, entries))  # held back by the parsers
                continue
            taken += entries
        self._waiting = kept
        return taken


def token_text(entry: ChatLogprobToken) -> str:
    """The text of a logprob entry's token on its own (its ``bytes``; the ``token`` when it
    has none)."""
    if entry.bytes is None:
        return entry.token
    return bytes(entry.bytes).decode("utf-8", errors="replace")


def token_units(
    text: str, entries: list[ChatLogprobToken]
) -> list[tuple[str, list[ChatLogprobToken]]]:
    """One engine output (``text``, its tokens' ``entries`` in order) split into units of
    ``(text, entries)`` whose texts join to ``text``: a unit per token whose own text
    (:func:`token_text`) comes next in ``text``, with the tokens before it that have none
    there (special tokens the detokenizer skipped); a last unit of ``""`` for such tokens at
    the end. When the tokens' texts do not make up ``text`` exactly, the whole output is one
    unit (the reference behaviour: its tokens go together)."""
    units: list[tuple[str, list[ChatLogprobToken]]] = []
    pending: list[ChatLogprobToken] = []
    position = 0
    for entry in entries:
        piece = token_text(entry)
        if piece and text.startswith(piece, position):
            units.append((piece, [*pending, entry]))
            pending = []
            position += len(piece)
        else:
            pending.append(entry)
    if position != len(text):  # (so ``text`` is not empty)
        return [(text, list(entries))]
    if pending:
        units.append(("", pending))
    return units
