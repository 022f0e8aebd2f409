"""OpenAI-style chat messages -> the prompt text of a chat template (``LLM.chat`` and the
server's ``/v1/chat/completions`` both render through :func:`render_chat`).

Messages are normalized to what templates expect. Content takes the shape the template
reads (vLLM's ``--chat-template-content-format``, :mod:`chassis.core.chat_content_format`):
``string`` joins the text parts into one string (absent content, an assistant turn that
only calls tools, is the empty string); ``openai`` passes a list of text parts,
``[{"type": "text", "text": ...}]`` (a string is one part, absent content the empty list;
a ``tool`` message's content stays a string, as in vLLM); ``auto`` (the default) picks
one from the template. Other part types are refused either way, but for the media markers
``{"type": "image"}`` and ``{"type": "video"}`` that :mod:`chassis.core.chat_media` puts in
place of a request's image and video parts when the engine takes them: ``openai`` passes
them to the template as parts, and ``string`` writes the model's placeholder text for each
(vLLM's rule: before the message's text, one line each, unless the text already holds it). Tool-call ``arguments``
sent as JSON strings are parsed to objects (templates index into them). Template failures
(``raise_exception`` in the template, messages shaped unlike what it indexes) become
``ValueError``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateSyntaxError

from chassis.core.chat_content_format import (
    ContentFormat,
    check_content_format,
    resolve_content_format,
)
from chassis.core.tokenizer import NoChatTemplateError, apply_chat_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ChatMessageError(ValueError):
    """A message the renderer cannot use; ``index`` is its position in the conversation."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


class ChatTemplateSyntaxError(ValueError):
    """The chat template itself does not parse (a Jinja syntax error), whatever the
    messages: the fault of whoever supplied the template."""


class ChatTemplateRenderError(ValueError):
    """The chat template parsed but failed on these messages: it refused them
    (``raise_exception``), or indexed or computed something they do not support. The
    message says what the template raised."""


#: what stands for an image in normalized content (``openai``), as templates test for it
IMAGE_PART: dict[str, str] = {"type": "image"}
#: what stands for a video (Qwen2-VL's template writes ``<|video_pad|>`` for it)
VIDEO_PART: dict[str, str] = {"type": "video"}
#: what stands for an audio clip (Qwen2-Audio's template writes ``<|AUDIO|>`` for it)
AUDIO_PART: dict[str, str] = {"type": "audio"}


def _placeholders(image: str | None, video: str | None, audio: str | None = None) -> dict[str, str]:
    """Marker type -> the model's text for one item, for the markers taken."""
    kinds = (("image", image), ("video", video), ("audio", audio))
    return {kind: text for kind, text in kinds if text is not None}


def content_text(
    content: str | list[dict[str, Any]] | None,
    index: int,
    image_placeholder: str | None = None,
    video_placeholder: str | None = None,
    audio_placeholder: str | None = None,
) -> str:
    """OpenAI content (a string or a list of parts) as one string; only text parts allowed,
    and image (video, audio) markers when ``image_placeholder`` (``video_placeholder``,
    ``audio_placeholder``: the model's text for one image, one video, one clip) is given:
    each becomes that text on its own line before the message's text, unless the text
    already holds it (vLLM's rule; the kinds in the order of their first marker).

    Absent content (``None``) is the empty string, which templates handle; many index
    ``message['content']`` directly.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    placeholders = _placeholders(image_placeholder, video_placeholder, audio_placeholder)
    parts = _texts(content, index, markers=frozenset(placeholders))
    text = "\n".join(part for kind, part in parts if kind == "text")
    counts: dict[str, int] = {}
    for kind, _ in parts:
        if kind != "text":
            counts[kind] = counts.get(kind, 0) + 1
    lines = []
    for kind, count in counts.items():
        placeholder = placeholders[kind]
        lines += [placeholder] * max(0, count - text.count(placeholder))
    return "\n".join([*lines, text])


def content_parts(
    content: str | list[dict[str, Any]] | None,
    index: int,
    *,
    images: bool = False,
    videos: bool = False,
    audios: bool = False,
) -> list[dict[str, str]]:
    """OpenAI content as a list of text parts (``[{"type": "text", "text": ...}]``, fresh
    dicts holding only those keys), as vLLM gives templates that loop over the parts: a
    string is one part, absent content (``None``) no part; only text parts allowed, and
    with ``images`` (``videos``) the image markers (:data:`IMAGE_PART`; the video markers,
    :data:`VIDEO_PART`; with ``audios`` the audio markers, :data:`AUDIO_PART`), in place."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    kinds = (("image", images), ("video", videos), ("audio", audios))
    markers = frozenset(kind for kind, on in kinds if on)
    return [
        {"type": "text", "text": text} if kind == "text" else {"type": kind}
        for kind, text in _texts(content, index, markers=markers)
    ]


def _texts(content: object, index: int, *, markers: frozenset[str]) -> list[tuple[str, str]]:
    """The parts of a list of content parts as ``(kind, text)``: ``("text", its text)``, or
    ``(marker type, "")`` for a media marker whose type is in ``markers`` (``"image"``,
    ``"video"``); ``ChatMessageError`` for anything else."""
    if not isinstance(content, list):
        raise ChatMessageError(
            f"messages[{index}].content must be a string or a list of parts; got "
            f"{type(content).__name__}",
            index,
        )
    texts: list[tuple[str, str]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in markers and len(part) == 1:
            texts.append((kind, ""))
            continue
        if kind != "text":
            raise ChatMessageError(
                f"messages[{index}].content: only text parts are supported; got type {kind!r}",
                index,
            )
        if not isinstance(part.get("text"), str):
            raise ChatMessageError(
                f"messages[{index}].content[{j}]: a text part needs a string field 'text'", index
            )
        texts.append(("text", part["text"]))
    return texts


def _tool_calls_for_template(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for call in tool_calls:
        call = dict(call)
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            function = dict(function)
            # not JSON: give the template the string as sent
            with contextlib.suppress(json.JSONDecodeError):
                function["arguments"] = json.loads(function["arguments"])
            call["function"] = function
        out.append(call)
    return out


def normalize_messages(
    messages: Sequence[Mapping[str, Any]],
    content_format: ContentFormat = "string",
    image_placeholder: str | None = None,
    video_placeholder: str | None = None,
    audio_placeholder: str | None = None,
) -> list[dict[str, Any]]:
    """The plain dicts chat templates iterate over (see the module docstring), ``content``
    in ``content_format`` (``"string"`` or ``"openai"``; a ``tool`` message's is a string
    either way, as vLLM gives it); keys other than ``content`` and ``tool_calls`` (``name``,
    ``tool_call_id``, ``reasoning_content``...) pass through unchanged; a ``reasoning`` (the
    response field) is also given as ``reasoning_content`` when that is absent. Image
    (video) markers are taken only with ``image_placeholder`` (``video_placeholder``: the
    model's text for one image, one video, written for each in ``string`` content; audio
    markers likewise with ``audio_placeholder``). The input is not modified."""
    if content_format not in ("string", "openai"):
        raise ValueError(f"content_format must be 'string' or 'openai'; got {content_format!r}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatMessageError(f"messages[{i}] must be an object with a string 'role'", i)
        item = {k: v for k, v in message.items() if v is not None or k == "content"}
        if content_format == "openai" and message["role"] != "tool":
            item["content"] = content_parts(
                message.get("content"),
                i,
                images=image_placeholder is not None,
                videos=video_placeholder is not None,
                audios=audio_placeholder is not None,
            )
        else:
            # vLLM joins a tool message's text parts also in "openai": templates write
            # tool results as strings
            item["content"] = content_text(
                message.get("content"), i, image_placeholder, video_placeholder, audio_placeholder
            )
        if message.get("tool_calls") is not None:
            item["tool_calls"] = _tool_calls_for_template(message["tool_calls"])
        if "reasoning" in item and "reasoning_content" not in item:
            # vLLM's response field, sent back; templates (Qwen3's) read reasoning_content
            item["reasoning_content"] = item["reasoning"]
        out.append(item)
    return out


def chat_template_text(
    tokenizer: PreTrainedTokenizerBase,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str | None:
    """The text of the template :func:`render_chat` renders with: ``chat_template`` (a
    template's text), else the tokenizer's, the one transformers picks for ``tools`` when
    the tokenizer has several by name (``tool_use`` with tools, else ``default``); ``None``
    when there is none."""
    if chat_template is not None:
        return chat_template
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return tokenizer.get_chat_template(None, tools=tools)
    except ValueError:  # named templates without a default: rendering says so
        return None


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    content_format: str = "auto",
    image_placeholder: str | None = None,
    video_placeholder: str | None = None,
    audio_placeholder: str | None = None,
) -> str:
    """The prompt text of one conversation.

    ``chat_template`` (the template text) overrides the tokenizer's; ``continue_final_message``
    leaves the last (assistant) message open for the model to continue, and cannot be combined
    with ``add_generation_prompt``; ``tools`` and ``chat_template_kwargs`` (e.g. Qwen3's
    ``enable_thinking``) reach the template; ``content_format`` (``"auto"``, ``"string"`` or
    ``"openai"``, vLLM's ``chat_template_content_format``) is the shape of the messages'
    content, ``"auto"`` detected from the template that renders (:func:`chat_template_text`).
    ``image_placeholder`` (the model's text for one image) lets the messages hold the image
    markers :mod:`chassis.core.chat_media` leaves, ``video_placeholder`` the video markers,
    ``audio_placeholder`` the audio markers; without it they are refused. Raises
    ``ChatMessageError`` for a message it cannot use, ``ChatTemplateSyntaxError`` for a
    template that does not parse, ``ChatTemplateRenderError`` (a ``ValueError``) when the
    template fails on the conversation, and ``ValueError`` for an unknown ``content_format``.
    """
    check_content_format(content_format)
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    kwargs = dict(chat_template_kwargs or {})
    # The caller owns these; template kwargs must not switch tokenization on.
    for reserved in ("tokenize", "return_dict", "chat_template"):
        kwargs.pop(reserved, None)
    if continue_final_message:
        kwargs["continue_final_message"] = True
    resolved = resolve_content_format(
        content_format, chat_template_text(tokenizer, chat_template, tools)
    )
    items = normalize_messages(
        messages, resolved, image_placeholder, video_placeholder, audio_placeholder
    )
    try:
        return apply_chat_template(
            tokenizer,
            items,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **kwargs,
        )
    except NoChatTemplateError:
        raise
    except TemplateSyntaxError as exc:  # the template's own fault, whatever the messages
        raise ChatTemplateSyntaxError(
            f"the chat template is not a valid Jinja template: {exc}"
        ) from None
    except ValueError as exc:
        raise ChatTemplateRenderError(f"cannot render the chat messages: {exc}") from None
    except Exception as exc:
        # The template is code: raise_exception(...), messages shaped unlike what it indexes
        # into, or a computation that fails on them (a division by zero, a range over the
        # sandbox's bound) are about these messages and this template, not a bug here.
        raise ChatTemplateRenderError(
            f"the chat template rejected the messages: {type(exc).__name__}: {exc}"
        ) from None
