"""Chat messages -> prompt text -> token ids, with the model's (or ``--chat-template``'s) template.

The server's side of :mod:`chassis.core.chat` (which ``LLM.chat`` shares): request models to
the message dicts it normalizes and renders, its ``ValueError``s to 400s, and the rendered
text tokenized *without* special tokens by default because the template already writes BOS.
Both steps are CPU work, so callers run :meth:`ChatRenderer.render_prompt` (text and ids) or
:meth:`ChatRenderer.render_ids` in a thread (``asyncio.to_thread``), never on the event loop.

A template sent with a request (its ``chat_template`` field, or ``chat_template`` inside its
``chat_template_kwargs``) is refused with a 400 unless the server trusts request templates
(vLLM's ``--trust-request-chat-template``): every route that renders messages passes its
request's fields here, so the policy holds for all of them (chat, Responses, embeddings,
``/classify``, ``/pooling``, ``/tokenize``).

Content reaches the template in the server's ``--chat-template-content-format`` (vLLM's
flag, :mod:`chassis.core.chat_content_format`): ``auto`` detects it per template (the
server's, or a request's own), logging what it found for the server's at start-up.

Image parts are taken only where the caller asks for the images (the chat completions
route, ``/v1/responses`` and ``/tokenize``) and the renderer has the engine's
:class:`~chassis.core.chat_media.ChatImages`: they are loaded (fetched, decoded) here, in the
same worker thread. On a route that does not ask (the pooling routes' ``messages``) an image
part is a 400 saying which routes take images; for an engine without them, a 400 like any
part that is not text. Video and audio parts likewise, where the caller asks for the
videos and clips too (the chat completions route); elsewhere a 400 naming the routes that
take them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from chassis.core.chat import (
    ChatMessageError,
    ChatTemplateRenderError,
    ChatTemplateSyntaxError,
    chat_template_text,
    render_chat,
)
from chassis.core.chat_content_format import check_content_format, resolve_content_format
from chassis.core.chat_media import IMAGE_PART_TYPES
from chassis.core.tokenizer import load_chat_template
from chassis.serve.errors import bad_request

#: the flag that lets requests bring their own chat template (named in the refusal)
TRUST_FLAG = "--trust-request-chat-template"

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from chassis.core.chat_media import ChatImages
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


def refuse_image_parts(messages: list[dict[str, Any]]) -> None:
    """A 400 naming the first image part of ``messages``, for a route that takes no images."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in (*IMAGE_PART_TYPES, "input_image", "image_embeds"):
                raise bad_request(
                    f"messages[{i}].content[{j}]: only text parts are supported on this "
                    f"route; got type {kind!r} (images are taken by /v1/chat/completions, "
                    "/v1/responses and /tokenize, for a model that takes them)",
                    f"messages.{i}.content",
                )


def request_chat_template(
    chat_template: str | None,
    chat_template_kwargs: dict[str, Any] | None,
    *,
    trusted: bool,
) -> str | None:
    """The template a request sends (its ``chat_template`` field, else ``chat_template`` in its
    ``chat_template_kwargs``), or ``None`` when it sends none.

    A 400 naming the field when the server does not trust request templates (``trusted``
    false), when the one in ``chat_template_kwargs`` is not a string, or when the template
    is empty (only whitespace: it would render an empty prompt). The value is the
    template text itself, never a path: a request must not make the server read its files.
    """
    in_kwargs = (chat_template_kwargs or {}).get("chat_template")
    if chat_template is None and in_kwargs is None:
        return None
    field = request_template_field(chat_template, chat_template_kwargs)
    if not trusted:
        raise bad_request(
            f"a chat template sent with the request ({field}) is refused: this server does not "
            f"trust request templates (start it with {TRUST_FLAG} to allow them, or set the "
            "server's template with --chat-template)",
            field,
        )
    own = chat_template if chat_template is not None else in_kwargs
    if not isinstance(own, str):
        raise bad_request(
            f"{field} must be the template's text; got {type(own).__name__}",
            field,
        )
    if not own.strip():
        raise bad_request(
            f"{field} is empty: send the template's text (or leave the field out for the "
            "server's template)",
            field,
        )
    return own


def request_template_field(
    chat_template: str | None, chat_template_kwargs: dict[str, Any] | None
) -> str:
    """The request field that carried its own template (``chat_template`` first): what a
    400 about that template names."""
    if chat_template is not None:
        return "chat_template"
    return "chat_template_kwargs.chat_template"


class ChatRenderer:
    """Renders chat requests for one tokenizer.

    ``chat_template`` is a ``--chat-template`` value (a file path or an inline Jinja string;
    ``None``: the tokenizer's own template), resolved once here so a bad path fails at start-up.
    ``trust_request_chat_template`` (``--trust-request-chat-template``) lets a request's own
    template replace it (:func:`request_chat_template`); otherwise such a request is a 400.
    ``chat_template_content_format`` (``--chat-template-content-format``: ``auto``,
    ``string`` or ``openai``) is the shape of the messages' content; with ``auto`` the
    server's template's is detected (and logged) here, a request's own template's when it
    renders. ``ValueError`` for another value. ``chat_images`` (the engine's; ``None``: image
    parts are refused) takes the image parts of the requests that ask for their images.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: str | None = None,
        *,
        trust_request_chat_template: bool = False,
        chat_template_content_format: str = "auto",
        chat_images: ChatImages | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_images = chat_images
        self.chat_template = load_chat_template(chat_template)
        self.trust_request_chat_template = trust_request_chat_template
        self.content_format = check_content_format(
            chat_template_content_format, "--chat-template-content-format"
        )
        #: the format the server's template renders with (what ``auto`` found for it)
        self.server_content_format = resolve_content_format(
            self.content_format, chat_template_text(tokenizer, self.chat_template)
        )

    def render(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        images: list[Any] | None = None,
        videos: list[Any] | None = None,
        audios: list[Any] | None = None,
    ) -> str:
        """The prompt text. ``chat_template`` (and ``chat_template`` in
        ``chat_template_kwargs``) is the request's own template: a 400 unless trusted (see
        :func:`request_chat_template`). A template that fails on the messages (refuses them,
        e.g. roles that must alternate, or raises computing on them) is a 400 naming
        ``messages``; a request's own template that does not parse, a 400 naming the field
        that carried it. Either message says whose template it was (the request's, the
        server's ``--chat-template`` or the model's). ``images``: a list the messages'
        images are appended to, in order, when the renderer has ``chat_images`` (a 400
        naming the part for one that cannot be taken); without ``images`` an image part is
        a 400 naming the routes that take images, and without ``chat_images`` one like any
        part that is not text. ``videos``: the same for video parts (vLLM's ``(frames,
        metadata)`` items), taken only with ``images`` given too; without it a video part
        is a 400 naming the routes that take videos. ``audios``: the same for audio parts
        (vLLM's ``(waveform, sample_rate)`` items)."""
        own = request_chat_template(
            chat_template, chat_template_kwargs, trusted=self.trust_request_chat_template
        )
        field_of_own = request_template_field(chat_template, chat_template_kwargs)
        try:
            dicts: list[Any] = [_as_dict(m) for m in messages]
            placeholder = video_placeholder = audio_placeholder = None
            if images is None:
                refuse_image_parts(dicts)
            elif self.chat_images is not None:
                media = self.chat_images.extract_media(
                    dicts, videos=videos is not None, audios=audios is not None
                )
                dicts, placeholder = media.messages, media.image_placeholder
                video_placeholder = media.video_placeholder
                audio_placeholder = media.audio_placeholder
                images.extend(media.images)
                if videos is not None:
                    videos.extend(media.videos)
                if audios is not None:
                    audios.extend(media.audios)
            return render_chat(
                self.tokenizer,
                dicts,
                chat_template=own if own is not None else self.chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                content_format=self.content_format,
                image_placeholder=placeholder,
                video_placeholder=video_placeholder,
                audio_placeholder=audio_placeholder,
            )
        except ChatMessageError as exc:
            raise bad_request(str(exc), f"messages.{exc.index}.content") from None
        except ChatTemplateSyntaxError as exc:
            # the request's own template: name its field; the model's (the server's own
            # --chat-template was parsed at start-up): the request is not at fault, but
            # nothing it sent can be named better than its messages
            field = field_of_own if own is not None else "messages"
            raise bad_request(f"{self._which(own, field_of_own)}: {exc}", field) from None
        except ChatTemplateRenderError as exc:
            # the template parsed but failed on these messages: name them, and say whose
            # template it was (the request's, the server's or the model's)
            raise bad_request(f"{self._which(own, field_of_own)}: {exc}", "messages") from None
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None

    def _which(self, own: str | None, field: str) -> str:
        """Whose template rendered a request: the request's own (sent as ``field``), the
        server's ``--chat-template`` or the model's tokenizer's."""
        if own is not None:
            return f"the request's template ({field})"
        if self.chat_template is not None:
            return "the server's chat template (--chat-template)"
        return "the model's chat template"

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
        chat_template: str | None = None,
        add_special_tokens: bool = False,
        images: list[Any] | None = None,
        videos: list[Any] | None = None,
        audios: list[Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The prompt text and its token ids (meant for a worker thread); the keyword
        arguments but ``add_special_tokens`` are :meth:`render`'s."""
        text = self.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            chat_template=chat_template,
            images=images,
            videos=videos,
            audios=audios,
        )
        return text, self.tokenize(text, add_special_tokens=add_special_tokens)
