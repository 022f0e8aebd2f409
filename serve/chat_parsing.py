"""Reasoning and tool-call parsing of generated chat messages (``--reasoning-parser``,
``--enable-auto-tool-choice --tool-call-parser``).

:class:`ChatParsers` holds the parser classes the server was started with and decides, per
request, which apply: the reasoning parser to every chat completion, the tool parser to a
request with ``tools`` whose ``tool_choice`` is ``"auto"`` (or absent). For each choice of such
a request it builds a :class:`ChoiceParser`, which runs the message text through the reasoning
parser and the *content* part through the tool parser (calls inside the reasoning are not
calls).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chassis.serve.errors import bad_request
from chassis.serve.forced_tool_calls import NamedToolCallParser, RequiredToolCallsParser
from chassis.serve.reasoning_parser import ReasoningDelta
from chassis.serve.tool_parser import ToolCall, ToolCallFragment, ToolDelta, join_fragments

if TYPE_CHECKING:
    from chassis.core.structured_output import StructuredOutputsParams
    from chassis.serve.protocol import ChatCompletionRequest
    from chassis.serve.reasoning_parser import ReasoningParser
    from chassis.serve.settings import ServerSettings
    from chassis.serve.tool_parser import ToolParser


@dataclass
class ChoiceDelta:
    """New reasoning, content and tool-call fragments of one choice.

    ``fragments`` use the choice's call indices (0, 1, ... in the order the calls start, after
    ``parallel_tool_calls``), each call's first fragment carries its name and id, and
    consecutive fragments of one call are merged. A call reported whole is one fragment.
    """

    reasoning: str = ""
    content: str = ""
    fragments: list[ToolCallFragment] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.fragments)

    def __iadd__(self, other: ChoiceDelta) -> ChoiceDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.fragments = _merged(self.fragments + other.fragments)
        return self

    @property
    def calls(self) -> list[ToolCall]:
        """The calls, whole: for a delta that holds all of its calls' fragments (what
        :meth:`ChoiceParser.parse` returns, or the sum of a choice's streamed deltas)."""
        return join_fragments(self.fragments)


def _merged(fragments: list[ToolCallFragment]) -> list[ToolCallFragment]:
    """``fragments`` with each run of one call's fragments made one (the first's name and
    id kept, the arguments joined)."""
    out: list[ToolCallFragment] = []
    for fragment in fragments:
        if out and out[-1].index == fragment.index and not fragment.starts_call:
            last = out[-1]
            out[-1] = ToolCallFragment(
                last.index, last.arguments + fragment.arguments, last.name, last.id
            )
        else:
            out.append(fragment)
    return out


class ChoiceParser:
    """Parses one choice's message, piece by piece (:meth:`feed`, then :meth:`finish` once) or
    whole (:meth:`parse`). ``include_reasoning`` false drops the reasoning text;
    ``parallel_tool_calls`` false keeps only the first call (the rest are dropped, as vLLM
    does: the model cannot be stopped from writing them).

    Calls come out as fragments (:class:`ChoiceDelta`): a tool parser's streamed fragments
    renumbered in the choice, its whole calls as one fragment each; a call the model wrote
    without an id gets one (:meth:`ToolParser.new_call_id`) on its first fragment."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolParser | None,
        include_reasoning: bool = True,
        parallel_tool_calls: bool = True,
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._include_reasoning = include_reasoning
        self._max_calls = None if parallel_tool_calls else 1
        #: tool calls started so far (the next call's index in the choice)
        self.num_calls = 0
        #: the choice index of each call the tool parser started (by its own index)
        self._indices: dict[int, int] = {}
        #: the message had reasoning (even when ``include_reasoning`` drops it)
        self.saw_reasoning = False

    @property
    def finish_reason_after_calls(self) -> str:
        """The finish reason of a choice that stopped after its calls: ``tool_calls``, or the
        tool parser's own (a named ``tool_choice`` keeps ``stop``)."""
        return self._tools.finish_reason_after_calls if self._tools else "tool_calls"

    def feed(self, text: str) -> ChoiceDelta:
        """The classified part of ``text``, the next piece of the message."""
        split = self._reasoning.feed(text) if self._reasoning else ReasoningDelta(content=text)
        return self._tool_pass(split, self._tools.feed(split.content) if self._tools else None)

    def finish(self) -> ChoiceDelta:
        """Everything still held back; call once, when the choice has finished."""
        split = self._reasoning.finish() if self._reasoning else ReasoningDelta()
        if self._tools is None:
            return self._tool_pass(split, None)
        found = self._tools.feed(split.content) if split.content else ToolDelta()
        found += self._tools.finish()
        return self._tool_pass(split, found)

    def parse(self, text: str) -> ChoiceDelta:
        """The whole message at once."""
        whole = self.feed(text)
        whole += self.finish()
        return whole

    def _tool_pass(self, split: ReasoningDelta, found: ToolDelta | None) -> ChoiceDelta:
        self.saw_reasoning = self.saw_reasoning or bool(split.reasoning)
        reasoning = split.reasoning if self._include_reasoning else ""
        if found is None or self._tools is None:
            return ChoiceDelta(reasoning, split.content)
        fragments: list[ToolCallFragment] = []
        for fragment in found.fragments:
            if fragment.starts_call:
                if fragment.index in self._indices:
                    raise ValueError(
                        f"tool parser {type(self._tools).__name__} started call "
                        f"{fragment.index} twice"
                    )
                index = self._start(fragment.index)
                if index is not None:
                    call_id = fragment.id or self._tools.new_call_id()
                    fragments.append(
                        ToolCallFragment(index, fragment.arguments, fragment.name, call_id)
                    )
                continue
            if fragment.index not in self._indices:
                raise ValueError(
                    f"tool parser {type(self._tools).__name__} sent arguments of call "
                    f"{fragment.index} before its start (the fragment with its name)"
                )
            index = self._indices[fragment.index]
            if index >= 0:
                fragments.append(ToolCallFragment(index, fragment.arguments))
        for call in found.calls:  # a parser that reports whole calls
            index = self._start(None)
            if index is not None:
                call_id = call.id or self._tools.new_call_id()
                fragments.append(ToolCallFragment(index, call.arguments, call.name, call_id))
        return ChoiceDelta(reasoning, found.content, _merged(fragments))

    def _start(self, parser_index: int | None) -> int | None:
        """The choice index of a call the tool parser starts (``parser_index``: its own
        index, for streamed calls), or ``None`` when ``parallel_tool_calls`` drops it."""
        if self._max_calls is not None and self.num_calls >= self._max_calls:
            if parser_index is not None:
                self._indices[parser_index] = -1  # dropped: so are its later fragments
            return None
        index = self.num_calls
        self.num_calls += 1
        if parser_index is not None:
            self._indices[parser_index] = index
        return index


@dataclass(frozen=True)
class ChatParsers:
    """The parser classes of one server (``None``: that kind of parsing is off)."""

    reasoning_cls: type[ReasoningParser] | None = None
    tool_cls: type[ToolParser] | None = None

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> ChatParsers:
        """Resolve the settings' parser names in the plugin registries.

        Raises ``ValueError`` for an unknown name (the message lists the known ones) and for
        ``--enable-auto-tool-choice`` without ``--tool-call-parser``. A tool parser without
        ``--enable-auto-tool-choice`` is checked but not used.
        """
        from chassis.plugins.registries import get_registries

        if settings.enable_auto_tool_choice and not settings.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
        registries = get_registries()
        reasoning_cls = tool_cls = None
        if settings.reasoning_parser:
            reasoning_cls = registries.reasoning_parsers.get(settings.reasoning_parser)
        if settings.tool_call_parser:
            tool_cls = registries.tool_parsers.get(settings.tool_call_parser)
        if not settings.enable_auto_tool_choice:
            tool_cls = None  # the name is checked all the same
        return cls(reasoning_cls, tool_cls)

    def tool_parsing(self, body: ChatCompletionRequest) -> bool:
        """Whether ``body``'s output is parsed for tool calls; a 400 for a ``tool_choice``
        this server cannot honour.

        ``"none"`` (or no ``tools``): never. ``"auto"``: needs ``--enable-auto-tool-choice``.
        Absent: ``"auto"`` when the server has a tool parser, else the tools only reach the
        chat template and calls come back as text. ``"required"`` and named functions: always,
        with or without a tool parser: the output is constrained to the calls' JSON.
        """
        choice = body.tool_choice
        if body.forces_tool_calls:
            return True
        if not body.tools or choice == "none":
            return False
        if self.tool_cls is None:
            if choice == "auto":
                raise bad_request(
                    "tool_choice 'auto' needs the server to be started with "
                    "--enable-auto-tool-choice and --tool-call-parser",
                    "tool_choice",
                )
            return False
        return True

    def for_request(
        self,
        body: ChatCompletionRequest,
        tokenizer: Any,
        prompt: str,
        constraint: StructuredOutputsParams | None = None,
    ) -> RequestParsing | None:
        """How ``body``'s choices are parsed, or ``None`` when they are not (the text is all
        content). ``constraint`` is the request's structured-output constraint (its
        ``SamplingParams.structured_outputs``). Raises the 400s of :meth:`tool_parsing`."""
        tools = self.tool_parsing(body)
        # Constrained output holds reasoning only when the engine leaves the reasoning free:
        # for a JSON constraint (JSON cannot start with the whitespace the reasoning parser
        # strips from the answer) and a format with single-token tags. Otherwise it is
        # constrained from its first token, and the reasoning parser would misread it.
        reasoning_cls = self.reasoning_cls
        after_reasoning = False
        if reasoning_cls is not None and constraint is not None:
            after_reasoning = (
                constraint.kind in ("json", "json_object")
                and reasoning_cls.reasoning_tags(tokenizer) is not None
            )
            if not after_reasoning:
                reasoning_cls = None
        if reasoning_cls is None and not tools:
            return None
        tool_cls = self.tool_cls if tools else None
        tool_list = list(body.tools or [])
        if isinstance(body.tool_choice, dict) and body.forces_tool_calls:
            tool_cls = NamedToolCallParser
            name = body.tool_choice["function"]["name"]
            tool_list = [t for t in tool_list if t["function"]["name"] == name]
        elif body.forces_tool_calls:
            tool_cls = RequiredToolCallsParser
        return RequestParsing(
            reasoning_cls,
            tool_cls,
            tokenizer,
            prompt,
            tool_list,
            body.include_reasoning is not False,
            body.parallel_tool_calls is not False,
            after_reasoning,
        )


@dataclass(frozen=True)
class RequestParsing:
    """The parsing of one request: makes a :class:`ChoiceParser` per choice."""

    reasoning_cls: type[ReasoningParser] | None
    tool_cls: type[ToolParser] | None
    tokenizer: Any
    prompt: str
    tools: list[dict[str, Any]]
    include_reasoning: bool
    parallel_tool_calls: bool
    #: the request's constraint applies after the reasoning (set
    #: ``StructuredOutputsParams.after_reasoning``)
    constrained_after_reasoning: bool = False

    @property
    def needs_special_tokens(self) -> bool:
        """A parser reads special tokens, so the text must keep them."""
        return bool(self.tool_cls and self.tool_cls.needs_special_tokens) or bool(
            self.reasoning_cls and self.reasoning_cls.needs_special_tokens
        )

    def choice_parser(self) -> ChoiceParser:
        reasoning = self.reasoning_cls(self.tokenizer, self.prompt) if self.reasoning_cls else None
        tools = self.tool_cls(self.tokenizer, self.tools) if self.tool_cls else None
        return ChoiceParser(reasoning, tools, self.include_reasoning, self.parallel_tool_calls)


def finish_reason(reason: str | None, parser: ChoiceParser) -> str | None:
    """OpenAI's ``tool_calls`` for a choice that stopped after calling tools (``stop`` still
    when ``tool_choice`` named the function, as OpenAI and vLLM answer then)."""
    if reason == "stop" and parser.num_calls:
        return parser.finish_reason_after_calls
    return reason


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    """A whole call (its id set by :class:`ChoiceParser`) as an item of OpenAI's
    ``message.tool_calls``."""
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def tool_call_delta_json(fragment: ToolCallFragment) -> dict[str, Any]:
    """A fragment of a :class:`ChoiceDelta` as an item of a streamed ``delta.tool_calls``,
    as OpenAI sends them: a call's first item carries ``index``, ``id``, ``type`` and
    ``function.name`` with the first piece of ``function.arguments`` (maybe ``""``); later
    items only ``index`` and the next piece of ``function.arguments``."""
    if not fragment.starts_call:
        return {"index": fragment.index, "function": {"arguments": fragment.arguments}}
    return {
        "index": fragment.index,
        "id": fragment.id,
        "type": "function",
        "function": {"name": fragment.name, "arguments": fragment.arguments},
    }
