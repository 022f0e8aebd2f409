"""What every image processor here reads from a checkpoint before its own settings: the
``preprocessor_config.json`` path, the config's ``image_token_id``, the optional
``processor_config.json``, the video processor's config, and its image tokens' ids in the tokenizer — with the same refusals
(``ValueError``) for every model."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def image_processor_source(model_dir: str | Path, hf_config: Any) -> tuple[Path, int]:
    """``(path of model_dir's preprocessor_config.json, hf_config.image_token_id)``;
    ``ValueError`` when the file is missing (checked first) or the config has no
    ``image_token_id``. The file is not read: each model parses its own settings."""
    path = Path(model_dir) / "preprocessor_config.json"
    if not path.is_file():
        raise ValueError(
            f"the checkpoint {str(model_dir)!r} has no preprocessor_config.json: its image "
            "processor settings are unknown, so it cannot take images"
        )
    image_token_id = getattr(hf_config, "image_token_id", None)
    if image_token_id is None:
        raise ValueError("the model's config lacks image_token_id: it cannot take images")
    return path, int(image_token_id)


def saved_processor_config(model_dir: str | Path) -> dict[str, Any]:
    """The contents of ``model_dir``'s ``processor_config.json``; ``{}`` without one (each
    model then uses transformers' defaults)."""
    path = Path(model_dir) / "processor_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def video_processor_config(model_dir: str | Path) -> dict[str, Any]:
    """The contents of ``model_dir``'s ``video_preprocessor_config.json``, else of its
    ``preprocessor_config.json`` (transformers' fallback for a video processor);
    ``ValueError`` when it has neither (its video settings are unknown)."""
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            return dict(json.loads(path.read_text()))
    raise ValueError(
        f"the checkpoint {str(model_dir)!r} has no video_preprocessor_config.json or "
        "preprocessor_config.json: its video settings are unknown"
    )


def image_token_ids(
    tokenizer: Any, names: Sequence[str], image_token: str, image_token_id: int
) -> list[int]:
    """The ids of the token texts ``names`` in ``tokenizer``, in order; ``ValueError`` when
    one is not a single known token, or when ``image_token`` (one of ``names``) is not
    token ``image_token_id`` (the model's config and the tokenizer must agree)."""
    ids = []
    for name in names:
        token_id = tokenizer.convert_tokens_to_ids(name)
        # (an unknown token converts to the unknown token's id, or to None)
        known = isinstance(token_id, int) and token_id != tokenizer.unk_token_id
        if not known or tokenizer.convert_ids_to_tokens(token_id) != name:
            raise ValueError(
                f"the checkpoint's tokenizer has no {name!r} token: it cannot take images"
            )
        ids.append(token_id)
    found = ids[list(names).index(image_token)]
    if found != image_token_id:
        raise ValueError(
            f"the tokenizer's {image_token!r} is token {found}, but the config's "
            f"image_token_id is {image_token_id}"
        )
    return ids
