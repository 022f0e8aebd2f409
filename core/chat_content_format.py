"""Which shape a chat template expects a message's ``content`` in: vLLM's
``--chat-template-content-format {auto,string,openai}`` (and ``LLM.chat``'s
``chat_template_content_format``).

Contract:

* ``"string"``: the template gets ``content`` as one string (text parts joined by newlines;
  absent content is ``""``). Templates that write ``{{ message['content'] }}`` want this.
* ``"openai"``: the template gets ``content`` as a list of OpenAI text parts,
  ``[{"type": "text", "text": ...}]`` (a string is one part, absent content ``[]``), as
  templates that loop ``{% for part in message['content'] %}`` want. :mod:`chassis.core.chat`
  shapes the messages (and keeps vLLM's exception: a ``tool`` message's content stays a
  string).
* ``"auto"`` (the default): :func:`detect_content_format` reads the template and picks one of
  the two. :func:`resolve_content_format` returns an explicit choice unchanged and otherwise
  detects; it logs the detected format (INFO) the first time it sees a template's text.

Detection (:func:`detect_content_format`, cached per template text) parses the template
with the Jinja environment transformers renders chat templates with (so its extensions,
``{% generation %}``, parse) and answers ``"openai"`` when some ``for`` loop iterates over a
message's content, else ``"string"``:

* the messages are ``messages``, or a variable set from it, a slice of it or a filter of it
  (``{% set loop_messages = messages[1:] %}``), transitively;
* a message is the loop variable, whatever its name, of a ``for`` over the messages;
* a message's content is ``message['content']`` or ``message.content`` (also under a filter,
  a test or a slice), or a variable set from one (``{% set content = message['content'] %}``,
  transitively), or any variable named ``content`` (a macro's parameter, as vLLM counts it).

The loop counts wherever it is, also in a branch the template takes only for non-string
content (``{% if message['content'] is string %}...{% else %}{% for part in ... %}``), so a
template handling both shapes is ``"openai"``, as in vLLM. A template that does not parse is
``"string"`` (rendering it reports its syntax error). Scoping is ignored (a name set anywhere
counts everywhere), as in vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator
from functools import lru_cache
from typing import Literal, cast

from jinja2 import nodes

logger = logging.getLogger(__name__)

ContentFormat = Literal["string", "openai"]
ContentFormatOption = Literal["auto", "string", "openai"]
#: the values ``--chat-template-content-format`` (and ``chat_template_content_format``) take
CONTENT_FORMAT_OPTIONS: tuple[ContentFormatOption, ...] = ("auto", "string", "openai")


def check_content_format(
    value: object, name: str = "chat_template_content_format"
) -> ContentFormatOption:
    """``value`` as a content-format option; ``ValueError`` naming ``name`` otherwise."""
    if value not in CONTENT_FORMAT_OPTIONS:
        raise ValueError(
            f"{name} must be one of {', '.join(map(repr, CONTENT_FORMAT_OPTIONS))}; got {value!r}"
        )
    return cast("ContentFormatOption", value)


def resolve_content_format(option: str, template: str | None) -> ContentFormat:
    """The format to render with: ``option`` when it is ``"string"`` or ``"openai"``;
    for ``"auto"``, :func:`detect_content_format` of ``template`` (the text of the template
    that renders; ``None``, no template at all, is ``"string"``). Raises ``ValueError`` for
    an unknown option."""
    option = check_content_format(option)
    if option != "auto":
        return option
    if template is None:
        return "string"
    detected = detect_content_format(template)
    _log_detected(template, detected)
    return detected


@lru_cache(maxsize=64)
def detect_content_format(template: str) -> ContentFormat:
    """``"openai"`` when ``template`` loops over a message's content, else ``"string"``
    (the rules are the module docstring's)."""
    root = _parse(template)
    if root is None:
        return "string"
    return "openai" if any(True for _ in _content_loops(root)) else "string"


@lru_cache(maxsize=64)
def _log_detected(template: str, detected: ContentFormat) -> None:
    """Once per template text (and format): what ``auto`` found."""
    shape = "one string" if detected == "string" else "a list of text parts"
    logger.info(
        "detected the chat template content format to be '%s' (message content reaches the "
        "template as %s); set --chat-template-content-format (LLM.chat: "
        "chat_template_content_format) to override",
        detected,
        shape,
    )


def _parse(template: str) -> nodes.Template | None:
    """The template's AST, parsed as transformers compiles chat templates; ``None`` when
    it does not parse."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        return _compile_jinja_template(template).environment.parse(template)
    except Exception as exc:  # a syntax error: the render reports it
        logger.debug("chat template content format: the template does not parse: %s", exc)
        return None


def _unwrap(node: nodes.Node) -> nodes.Node:
    """The expression under filters, tests and slices: ``messages[1:] | list`` is read as
    ``messages``."""
    while _wraps(node):
        node = node.node  # type: ignore[attr-defined]
    return node


def _wraps(node: nodes.Node) -> bool:
    if isinstance(node, nodes.Filter | nodes.Test):
        return node.node is not None  # a filter block's Filter has none
    return isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)


def _is_name(node: nodes.Node, names: Collection[str]) -> bool:
    node = _unwrap(node)
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _is_key(node: nodes.Node, owners: Collection[str], key: str) -> bool:
    """``owner['key']`` or ``owner.key`` (under filters, tests and slices) for an owner
    named in ``owners``."""
    node = _unwrap(node)
    if isinstance(node, nodes.Getitem):
        return (
            isinstance(node.arg, nodes.Const)
            and node.arg.value == key
            and _is_name(node.node, owners)
        )
    if isinstance(node, nodes.Getattr):
        return node.attr == key and _is_name(node.node, owners)
    return False


def _set_closure(
    root: nodes.Template, names: Collection[str], *, content_of: Collection[str] = ()
) -> set[str]:
    """``names`` plus every variable ``{% set %}`` from one of them (or from the content of a
    message named in ``content_of``: ``{% set c = message['content'] %}``), transitively."""
    out = set(names)
    assigns = [a for a in root.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)]
    changed = True
    while changed:
        changed = False
        for assign in assigns:
            target = cast("nodes.Name", assign.target).name
            if target not in out and (
                _is_name(assign.node, out) or _is_key(assign.node, content_of, "content")
            ):
                out.add(target)
                changed = True
    return out


def _content_loops(root: nodes.Template) -> Iterator[nodes.For]:
    """The ``for`` loops over a message's content."""
    messages = _set_closure(root, {"messages"})
    loops = list(root.find_all(nodes.For))
    message_names = frozenset(
        loop.target.name
        for loop in loops
        if isinstance(loop.target, nodes.Name) and _is_name(loop.iter, messages)
    )
    contents = _set_closure(root, {"content"}, content_of=message_names)
    for loop in loops:
        if _is_key(loop.iter, message_names, "content") or _is_name(loop.iter, contents):
            yield loop
