"""Tokenizer loading, EOS ids and chat templates for the front-end.

The front-end owns the tokenizer: it turns prompts (or chat messages) into token ids and token
ids back into text. Everything here is a thin, documented layer over ``transformers`` so the
rest of the engine never touches ``AutoTokenizer`` directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from chassis.core.config import EngineConfig

#: Characters that only appear in an inline Jinja template, never in a plain file path.
_JINJA_MARKERS = ("{{", "{%", "{#", "\n")

GENERATION_CONFIG_FILE = "generation_config.json"


def load_tokenizer(
    path: str | Path,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    use_fast: bool = True,
    **kwargs: Any,
) -> PreTrainedTokenizerBase:
    """Load the (fast, Rust-backed where available, unless ``use_fast`` is false) tokenizer
    of a model.

    ``path`` is a local directory with tokenizer files or a hub id. Extra ``kwargs`` go to
    ``AutoTokenizer.from_pretrained`` (e.g. ``gguf_file=...``). Raises ``ValueError`` with the
    path when nothing loadable is there. A byte-level BPE saved with a sentencepiece decoder in
    front of its ``ByteLevel`` one gets the plain decoder (:func:`repair_byte_level_decoder`).
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(path),
            revision=revision,
            trust_remote_code=trust_remote_code,
            use_fast=use_fast,
            **kwargs,
        )
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {str(path)!r}: {e}") from e
    repair_byte_level_decoder(tokenizer)
    return tokenizer


def engine_tokenizer(config: EngineConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of an engine of ``config``: ``config.tokenizer`` (a local directory or a
    hub id, fetched at ``tokenizer_revision`` into ``download_dir``) with its
    ``trust_remote_code`` and ``tokenizer_mode``. Every part of the front-end that needs the
    engine's tokenizer loads it here, so they all load the same one."""
    assert config.tokenizer is not None, "finalize_config sets the tokenizer"
    kwargs: dict[str, Any] = {}
    if config.download_dir is not None:
        kwargs["cache_dir"] = config.download_dir
    return load_tokenizer(
        config.tokenizer,
        revision=config.tokenizer_revision,
        trust_remote_code=config.trust_remote_code,
        use_fast=config.tokenizer_mode != "slow",
        **kwargs,
    )


#: The decoder steps of a sentencepiece pipeline (byte tokens ``<0xNN>`` to bytes, join the
#: tokens into one string, ``▁`` to a space), as the JSON the tokenizers library writes.
_SENTENCEPIECE_DECODER_STEPS = (
    {"type": "ByteFallback"},
    {"type": "Fuse"},
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
)


def _state(component: Any) -> dict[str, Any]:
    """The JSON form of a tokenizers pipeline component (``{}`` for none)."""
    return json.loads(component.__getstate__()) if component is not None else {}


def repair_byte_level_decoder(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Give a byte-level BPE tokenizer the plain ``ByteLevel`` decoder if a sentencepiece
    pipeline was put in front of it; return whether the decoder was replaced.

    transformers 5.17 (the GPU image's version) converts a GGUF file's GPT-2 style tokenizer
    (SmolLM2's, for one) with the decoder ``ByteFallback, Fuse, Replace("▁", " "),
    ByteLevel``. ``Fuse`` joins all tokens into one string before ``ByteLevel`` maps its
    characters back to bytes, and ``ByteLevel`` keeps a string holding any character outside
    its 256-character alphabet (a space, a newline, anything past U+0143) verbatim. So one
    added token such as ``"abc def"`` in a sequence makes the whole decode come back
    untranslated (``"ĠHello"`` for ``" Hello"``), in ``decode`` and in the incremental
    detokenizer alike; ``Replace`` and ``ByteFallback`` also rewrite added tokens holding
    ``▁`` or ``<0xNN>``. transformers 5.24 writes ``ByteLevel`` alone, as GPT-2 style
    checkpoints ship it, so the text no longer depends on which version converted the file.

    Only that exact shape is replaced (a BPE model with a ``ByteLevel`` pre-tokenizer, a
    ``Sequence`` decoder of one ``ByteLevel`` step and nothing but those sentencepiece
    steps); any other tokenizer is left as it is. Slow (Python) tokenizers have no such
    pipeline and are never changed.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return False
    decoder = _state(backend.decoder)
    if decoder.get("type") != "Sequence":
        return False
    steps = decoder.get("decoders") or []
    byte_level = [step for step in steps if step.get("type") == "ByteLevel"]
    others = [step for step in steps if step.get("type") != "ByteLevel"]
    if len(byte_level) != 1 or not others:
        return False
    if any(step not in _SENTENCEPIECE_DECODER_STEPS for step in others):
        return False
    pre = _state(backend.pre_tokenizer)
    pre_steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not any(step.get("type") == "ByteLevel" for step in pre_steps):
        return False
    from tokenizers import decoders

    options = {key: value for key, value in byte_level[0].items() if key != "type"}
    backend.decoder = decoders.ByteLevel(**options)
    return True


def eos_token_ids(
    tokenizer: PreTrainedTokenizerBase | None,
    hf_generation_config_path_or_dir: str | Path | None = None,
    *,
    hf_config: Any = None,
) -> list[int]:
    """The token ids that end generation: the tokenizer's EOS, then the model's extra ones.

    ``tokenizer`` may be ``None`` (``skip_tokenizer_init``): the ids then come from the model
    alone. ``hf_config`` (the model's ``PretrainedConfig``), when given, adds its
    ``eos_token_id`` (an int or a list). ``hf_generation_config_path_or_dir`` is a
    ``generation_config.json`` file or the model directory holding one; its ``eos_token_id``
    (an int or a list) is added when present. A missing file is not an error (many
    checkpoints have none). Order is kept, duplicates dropped.
    """
    ids: list[int] = []

    def add(value: Any) -> None:
        for token_id in [value] if isinstance(value, int) else value or []:
            if int(token_id) not in ids:
                ids.append(int(token_id))

    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    if hf_config is not None:
        add(getattr(hf_config, "eos_token_id", None))
    if hf_generation_config_path_or_dir is not None:
        path = Path(hf_generation_config_path_or_dir)
        if path.is_dir():
            path = path / GENERATION_CONFIG_FILE
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from e
            add(data.get("eos_token_id"))
    return ids


def load_chat_template(arg: str | Path | None) -> str | None:
    """Resolve a ``--chat-template`` value: a file path or an inline Jinja template string.

    ``None`` stays ``None`` (use the tokenizer's own template). A string containing Jinja
    markup (``{{``, ``{%``, ``{#``) or a newline is taken as the template itself; otherwise it
    must name an existing file, whose contents are returned. A path-like value that does not
    exist raises ``ValueError``.
    """
    if arg is None:
        return None
    text = str(arg)
    if any(marker in text for marker in _JINJA_MARKERS):
        return text
    path = Path(text).expanduser()
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as exc:  # no permission, not UTF-8 text, ...
            raise ValueError(f"--chat-template {text!r} cannot be read: {exc}") from None
    raise ValueError(
        f"--chat-template {text!r} is neither an existing file nor an inline Jinja template "
        "(an inline template must contain '{{', '{%' or '{#')"
    )


def check_chat_template(arg: str | Path) -> None:
    """Refuse a ``--chat-template`` value (:func:`load_chat_template`'s argument) that cannot
    serve any request: a file that cannot be read, or a template that is not valid Jinja,
    with a one-line ``ValueError`` naming the flag, the file (when it is one) and the line
    of the syntax error. The template is compiled as transformers compiles it to render
    (its sandboxed environment and extensions, ``{% generation %}`` included; the compile
    is cached), so what passes here parses when a request is rendered."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    text = load_chat_template(arg)
    assert text is not None
    try:
        _compile_jinja_template(text)
    except TemplateSyntaxError as exc:
        inline = any(marker in str(arg) for marker in _JINJA_MARKERS)
        where = "the inline template" if inline else repr(str(arg))
        raise ValueError(
            f"--chat-template: {where} is not a valid Jinja template: line {exc.lineno}: "
            + " ".join(str(exc.message).split())  # one line
        ) from None


class NoChatTemplateError(ValueError):
    """The tokenizer has no chat template and none was given."""


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Render chat ``messages`` to the prompt string the model expects.

    ``chat_template`` overrides the tokenizer's own template. ``add_generation_prompt`` appends
    the header of the assistant's turn. ``tools`` (OpenAI function schemas) and any other
    ``kwargs`` are passed to the template. Returns text, not token ids: tokenize it with
    ``InputProcessor`` (the template already contains any BOS, so callers that care may
    tokenize without special tokens). Raises :class:`NoChatTemplateError` (a ``ValueError``)
    when there is no template at all.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError(
            "this model's tokenizer has no chat template, so chat messages cannot be rendered; "
            "pass one with --chat-template (a file path or an inline Jinja string), or use the "
            "completions API with a plain prompt"
        )
    rendered = tokenizer.apply_chat_template(
        messages,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        tokenize=False,
        **kwargs,
    )
    if not isinstance(rendered, str):
        raise ValueError(f"the chat template rendered {type(rendered).__name__}, expected text")
    return rendered
