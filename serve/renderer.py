"""Chat messages -> prompt text -> token ids, with the model's (or ``--chat-template``'s) template.

The server's side of :mod:`chassis.core.chat` (which ``LLM.chat`` shares): request models to
the message dicts it normalizes and renders, its ``ValueError``s to 400s, and the rendered
text tokenized *without* special tokens by default because the template already writes BOS.
Both steps are CPU work, so callers run :meth:`ChatRenderer.render_prompt` (text and ids) or
:meth:`ChatRenderer.render_ids` in a thread (``asyncio.to_thread``), never on the event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from chassis.core.chat import ChatMessageError, render_chat
from chassis.core.tokenizer import load_chat_template
from chassis.serve.errors import bad_request

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from chassis.serve.protocol import ChatMessage


def _as_dict(message: ChatMessage) -> dict[str, Any]:
    """A request message as the dict :func:`~chassis.core.chat.render_chat` takes."""
    item: dict[str, Any] = {"role": message.role, "content": message.content}
    for key in ("name", "tool_calls", "tool_call_id"):
        value = getattr(message, key)
        if value is not None:
            item[key] = value
    item.update(message.model_extra or {})
    return item


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
        try:
            return render_chat(
                self.tokenizer,
                [_as_dict(m) for m in messages],
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
        except ChatMessageError as exc:
            raise bad_request(str(exc), f"messages.{exc.index}.content") from None
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None

    def tokenize(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """``text`` as token ids."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def render_ids(self, messages: list[ChatMessage], **kwargs: Any) -> list[int]:
        """Render and tokenize in one call (meant for a worker thread); the keyword arguments
        are :meth:`render_prompt`'s."""
        return self.render_prompt(messages, **kwargs)[1]

    def render_prompt(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> tuple[str, list[int]]:
        """The prompt text and its token ids (meant for a worker thread)."""
        text = self.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        return text, self.tokenize(text, add_special_tokens=add_special_tokens)
