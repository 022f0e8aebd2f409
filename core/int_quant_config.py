"""Where an AWQ or GPTQ checkpoint states how it is quantized, and the spellings it uses.

Newer exports write ``quantization_config`` into ``config.json``. Older ones ship a file
beside it instead, as vLLM also reads them (``get_quant_config``: GPTQ looks for
``quantize_config.json``; AWQ for ``quant_config.json`` or ``quantize_config.json``):

- AutoGPTQ (before transformers' integration): ``quantize_config.json`` with ``bits``,
  ``group_size``, ``desc_act``, ``sym``, often without ``quant_method``;
- AutoAWQ (before transformers' integration): ``quant_config.json`` (some exports
  ``quantize_config.json``) with ``w_bit``, ``q_group_size``, ``zero_point``, ``version``.

The precedence is vLLM's: ``config.json``'s ``quantization_config`` when it has one, else
the one file present. Unlike vLLM, which reads the file only when ``--quantization`` names the
method, chassis infers it (:func:`file_method`), and where vLLM silently takes the first of
two spellings or ignores a file that disagrees with ``config.json``, chassis refuses
contradictions by name (:func:`normalized_int_config`, :func:`checkpoint_int_config`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: the files older AWQ/GPTQ exports state their quantization in, in the order read
QUANT_CONFIG_FILES = ("quantize_config.json", "quant_config.json")
#: canonical key -> AutoAWQ's older spelling of it (read wherever the config comes from)
KEY_ALIASES = {"bits": "w_bit", "group_size": "q_group_size"}
#: keys only AutoAWQ writes: a file holding one of them and no ``quant_method`` is AWQ
_AWQ_ONLY_KEYS = ("w_bit", "q_group_size", "zero_point", "version")
#: keys only GPTQ tools write
_GPTQ_ONLY_KEYS = ("desc_act", "sym", "damp_percent", "true_sequential", "static_groups")
#: keys whose values must agree between config.json and a quantization file
_COMPARED_KEYS = ("quant_method", "bits", "group_size", "desc_act", "sym", "zero_point")


def normalized_int_config(config: dict[str, Any], source: str) -> dict[str, Any]:
    """``config`` with AutoAWQ's older spellings (``w_bit``, ``q_group_size``) read as
    ``bits`` and ``group_size``; ``ValueError`` naming ``source`` when both spellings are
    present with different values (vLLM would take ``w_bit`` silently)."""
    out = dict(config)
    for key, alias in KEY_ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if key in out and out[key] != value:
            raise ValueError(
                f"{source} states {key}={out[key]!r} and {alias}={value!r}, two spellings of "
                "one setting that contradict each other; fix the checkpoint's config"
            )
        out[key] = value
    return out


def file_method(config: dict[str, Any], file_name: str) -> str:
    """The quantization method of a quantization file: its ``quant_method`` when it states
    one; else AWQ for ``quant_config.json`` or for AutoAWQ's keys, GPTQ otherwise (AutoGPTQ's
    ``quantize_config.json``). ``ValueError`` for a file holding keys of both."""
    stated = config.get("quant_method")
    if stated is not None:
        return str(stated).lower()
    awq_keys = [k for k in _AWQ_ONLY_KEYS if k in config]
    gptq_keys = [k for k in _GPTQ_ONLY_KEYS if k in config]
    if awq_keys and gptq_keys:
        raise ValueError(
            f"{file_name} has no quant_method and holds both AWQ keys ({', '.join(awq_keys)}) "
            f"and GPTQ keys ({', '.join(gptq_keys)}); add quant_method to say which it is"
        )
    return "awq" if awq_keys or file_name == "quant_config.json" else "gptq"


def _read_file(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    # the method first: w_bit and q_group_size, AutoAWQ's own spellings, say AWQ
    method = file_method(config, path.name)
    config = normalized_int_config(config, path.name)
    config["quant_method"] = method
    return config


def _check_agree(
    chosen: dict[str, Any], chosen_name: str, other: dict[str, Any], name: str
) -> None:
    for key in _COMPARED_KEYS:
        if key in chosen and key in other and chosen[key] != other[key]:
            raise ValueError(
                f"{chosen_name} says {key}={chosen[key]!r} but {name} says {other[key]!r}: "
                "the checkpoint's quantization configs contradict each other; remove or fix "
                "the wrong one"
            )


def checkpoint_int_config(
    model_dir: str | Path, in_config_json: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The quantization config a checkpoint directory states, or ``None``.

    ``in_config_json`` (``config.json``'s ``quantization_config``) comes first when given;
    else the quantization file present (:data:`QUANT_CONFIG_FILES`), with its method
    inferred (:func:`file_method`) and its spellings read (:func:`normalized_int_config`).
    ``ValueError`` when the sources present disagree on the method, ``bits``,
    ``group_size``, ``desc_act``, ``sym`` or ``zero_point`` (vLLM would use the first
    silently, or refuse two files whatever they say), or when a file cannot be read.
    """
    model_dir = Path(model_dir)
    sources = [
        (name, _read_file(model_dir / name))
        for name in QUANT_CONFIG_FILES
        if (model_dir / name).is_file()
    ]
    if in_config_json is not None:
        stated = normalized_int_config(in_config_json, "config.json's quantization_config")
        sources.insert(0, ("config.json's quantization_config", stated))
    if not sources:
        return None
    chosen_name, chosen = sources[0]
    for name, other in sources[1:]:
        _check_agree(chosen, chosen_name, other, name)
    return chosen
