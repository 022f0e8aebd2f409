"""Chat messages -> prompt text -> token ids, with the model's (or ``--chat-template``'s) template.

The renderer is the only place the server turns OpenAI chat messages into what the template
expects: text content parts are joined into one string (non-text parts are rejected), tool-call
``arguments`` given as JSON strings are parsed to objects (templates index into them), and the
rendered text is tokenized *without* special tokens by default because the template already
writes BOS. Both steps are CPU work, so callers run :meth:`ChatRenderer.render_ids` in a
thread (``asyncio.to_thread``), never on the event loop.
"""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from chassis.core.tokenizer import apply_chat_template, load_chat_template
from chassis.serve.errors import bad_request

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from chassis.serve.protocol import ChatMessage


def _content_text(content: str | list[dict[str, Any]] | None, index: int) -> str:
    """OpenAI content (a string or a list of parts) as one string; only text parts allowed.

    Absent content (``null``: an assistant turn that only calls tools, as OpenAI allows) is
    the empty string, which templates handle; many index ``message['content']`` directly.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise bad_request(
                f"messages[{index}].content: only text parts are supported; got type {kind!r}",
                f"messages.{index}.content",
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(
                f"messages[{index}].content[{j}]: a text part needs a string field 'text'",
                f"messages.{index}.content",
            )
        texts.append(part["text"])
    return "\n".join(texts)


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


def messages_for_template(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as the plain dicts chat templates iterate over."""
    out = []
    for i, message in enumerate(messages):
        item: dict[str, Any] = {"role": message.role}
        item["content"] = _content_text(message.content, i)
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls is not None:
            item["tool_calls"] = _tool_calls_for_template(message.tool_calls)
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        item.update(message.model_extra or {})
        out.append(item)
    return out


class ChatRenderer:
    """Renders chat requests for one tokenizer.

    ``chat_template`` is a ``--chat-template`` value (a file path or an inline Jinja string;
    ``None``: the tokenizer's own template), resolved once here so a bad path fails at start-up.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = load_chat_template(chat_template)

    def render(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text. Template errors (e.g. roles that must alternate) raise a 400."""
        kwargs = dict(chat_template_kwargs or {})
        # The server owns these; a client must not switch tokenization on through the kwargs.
        for reserved in ("tokenize", "return_dict", "chat_template"):
            kwargs.pop(reserved, None)
        if continue_final_message:
            kwargs["continue_final_message"] = True
        try:
            return apply_chat_template(
                self.tokenizer,
                messages_for_template(messages),
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **kwargs,
            )
        except ValueError as exc:
            raise bad_request(f"cannot render the chat messages: {exc}", "messages") from None
        except (TemplateError, TypeError, KeyError) as exc:
            # raise_exception(...) in the template, or messages shaped unlike what the
            # template indexes into: the client's input, not a server bug.
            raise bad_request(
                f"the chat template rejected the messages: {type(exc).__name__}: {exc}",
                "messages",
            ) from None

    def tokenize(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """``text`` as token ids."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def render_ids(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Render and tokenize in one call (meant for a worker thread)."""
        text = self.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.tokenize(text, add_special_tokens=add_special_tokens)
