"""How a pooling engine (``runner="pooling"``) turns a prompt's hidden states into one vector.

The pooling type and whether vectors are L2-normalized come, in this order of precedence,
from the user's ``pooler_config`` (``EngineConfig.pooler_config``, ``--pooler-config``), from
the checkpoint's sentence-transformers files (``modules.json``, the ``Pooling`` module's
``config.json`` and whether a ``Normalize`` module follows it), and otherwise from vLLM's
default for the architecture: the last token for decoder language models, the first
(``CLS``) for BERT-like encoders, normalized. The checkpoint's ``Dense``
and ``LayerNorm`` modules (:mod:`chassis.core.pooling_dense`) always apply, whatever
``pooler_config`` says: a vector is pooled, run through them, truncated (Matryoshka
``dimensions``), then normalized, sentence-transformers' order.

Prefix caching needs the last-token pooler: a cached prefix has no hidden states in this
request, which every other type (mean, first token, max, sqrt-length and weighted means)
needs. :func:`apply_pooling_defaults` therefore turns prefix caching off for them (vLLM
turns off both prefix caching and chunked prefill; chassis keeps chunked prefill, the runner
carries a running state from chunk to chunk, see :mod:`chassis.core.pooler`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chassis.core.pooling_dense import (
    ST_PREFIX,
    ChainSpec,
    read_chain_specs,
    read_json,
    read_modules,
)

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig

logger = logging.getLogger(__name__)

#: the pooling types chassis implements: vLLM's names, then three sentence-transformers modes
#: vLLM does not have (the elementwise max over the tokens; their sum over sqrt(count);
#: their mean weighted by position, 1 to n)
POOLING_TYPES = ("LAST", "MEAN", "CLS", "MAX", "MEAN_SQRT_LEN", "WEIGHTED_MEAN")
#: the keys ``pooler_config`` accepts (``use_activation``: classification models only)
POOLER_CONFIG_KEYS = ("pooling_type", "normalize", "use_activation")
#: vLLM's older names of ``pooler_config`` keys
_KEY_ALIASES = {"activation": "use_activation", "softmax": "use_activation"}

#: sentence-transformers ``Pooling`` config keys -> chassis' type (the ones implemented)
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_max_tokens": "MAX",
    "pooling_mode_mean_sqrt_len_tokens": "MEAN_SQRT_LEN",
    "pooling_mode_weightedmean_tokens": "WEIGHTED_MEAN",
}
#: the same as the ``pooling_mode`` string some versions write; any other mode is refused
#: rather than ignored
_ST_STRING_MODES = {
    "lasttoken": "LAST",
    "mean": "MEAN",
    "cls": "CLS",
    "max": "MAX",
    "mean_sqrt_len_tokens": "MEAN_SQRT_LEN",
    "weightedmean": "WEIGHTED_MEAN",
}


@dataclass(frozen=True)
class PoolerConfig:
    """The resolved pooling of one engine: ``pooling_type`` (one of :data:`POOLING_TYPES`),
    ``normalize`` (L2-normalize each vector unless a request says otherwise; off for
    sequence classifiers, whose vectors are class logits) and ``use_activation`` (a
    classifier's outputs go through its activation, softmax by default, unless a request says
    otherwise; see :mod:`chassis.core.pooling_classify`), and ``dense``: the checkpoint's
    chain after the pooling (its ``Dense`` and ``LayerNorm`` modules, in order), run on the
    pooled vector before truncation and normalization (read from the checkpoint, never part
    of ``pooler_config``: :meth:`as_dict` leaves it out)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    use_activation: bool = True
    dense: tuple[ChainSpec, ...] = ()

    def embedding_size(self, hidden_size: int) -> int:
        """The length of a vector (before truncation) pooled from ``hidden_size`` states:
        the last ``Dense`` or ``LayerNorm`` module's ``out_features``, else ``hidden_size``."""
        return self.dense[-1].out_features if self.dense else hidden_size

    @property
    def needs_every_token(self) -> bool:
        """Whether the pooler reads hidden states before the last token (prefix caching,
        which skips computing a cached prefix, cannot serve it)."""
        return self.pooling_type != "LAST"

    def as_dict(self) -> dict[str, Any]:
        return {
            "pooling_type": self.pooling_type,
            "normalize": self.normalize,
            "use_activation": self.use_activation,
        }


def check_pooler_config(value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is ``None`` or a dict of known keys and values
    (``{"pooling_type": one of POOLING_TYPES, "normalize": bool, "use_activation": bool}``,
    each optional; vLLM's older ``activation`` and ``softmax`` name the last)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(
            f"--pooler-config must be a JSON object such as "
            f'{{"pooling_type": "MEAN", "normalize": true}}; got {value!r}'
        )
    unknown = sorted(set(value) - set(POOLER_CONFIG_KEYS) - set(_KEY_ALIASES))
    if unknown:
        raise ValueError(
            f"--pooler-config has unknown keys {unknown}; known: {', '.join(POOLER_CONFIG_KEYS)}"
        )
    pooling_type = value.get("pooling_type")
    if pooling_type is not None and (
        not isinstance(pooling_type, str) or pooling_type.upper() not in POOLING_TYPES
    ):
        raise ValueError(
            f"--pooler-config pooling_type must be one of {', '.join(POOLING_TYPES)}; "
            f"got {pooling_type!r}"
        )
    for key in ("normalize", "use_activation", *_KEY_ALIASES):
        flag = value.get(key)
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"--pooler-config {key} must be true or false; got {flag!r}")
    given = {value[k] for k in ("use_activation", *_KEY_ALIASES) if value.get(k) is not None}
    if len(given) > 1:
        raise ValueError(
            "--pooler-config use_activation and its older names (activation, softmax) disagree"
        )


def read_sentence_transformers_pooling(model_dir: str | Path) -> dict[str, Any] | None:
    """The pooling a sentence-transformers checkpoint declares, as ``pooler_config`` keys;
    ``None`` when ``model_dir`` has no ``modules.json``.

    As vLLM: the ``Pooling`` module's ``config.json`` names the type and the vector is
    normalized exactly when a ``Normalize`` module is listed (it comes last: after the
    chain of ``Dense`` and ``LayerNorm`` modules, which
    :func:`chassis.core.pooling_dense.read_chain_specs` reads).
    Raises ``ValueError`` for what chassis cannot reproduce: an unknown mode, several modes
    at once, and modules other than Transformer, Pooling, Dense, LayerNorm, Dropout and
    Normalize or out of that order.
    """
    directory = Path(model_dir)
    modules = read_modules(directory)
    if modules is None:
        return None
    types = [str(m.get("type", "")).removeprefix(ST_PREFIX) for m in modules]
    result: dict[str, Any] = {"normalize": "Normalize" in types}
    pooling = next((m for m, t in zip(modules, types, strict=True) if t == "Pooling"), None)
    if pooling is not None:
        pooling_file = directory / str(pooling.get("path", "")) / "config.json"
        result["pooling_type"] = _st_pooling_type(
            read_json(pooling_file) if pooling_file.is_file() else {}, pooling_file
        )
    logger.info("sentence-transformers pooling in %s: %s", directory, result)
    return result


def _st_pooling_type(pooling: Any, source: Path) -> str:
    if not isinstance(pooling, dict):
        raise ValueError(f"{source}: expected a JSON object")
    mode = pooling.get("pooling_mode")  # a string in some sentence-transformers versions
    if isinstance(mode, str):
        chosen = [mode]
        known = _ST_STRING_MODES
    else:
        chosen = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v is True]
        known = _ST_MODES
    unsupported = [m for m in chosen if m not in known]
    if unsupported:
        raise ValueError(
            f"{source}: pooling {', '.join(unsupported)} is not supported; chassis pools "
            "with the last token, the mean, the first token (CLS), the max, the sqrt-length "
            "mean or the weighted mean"
        )
    if len(chosen) > 1:
        raise ValueError(
            f"{source}: several pooling modes at once ({', '.join(chosen)}, concatenated) are "
            "not supported; pick one"
        )
    return known[chosen[0]] if chosen else "LAST"


def resolve_pooler_config(
    config: EngineConfig, *, check_dense_weights: bool = True
) -> PoolerConfig:
    """The pooling of ``config``'s engine: ``config.pooler_config``'s values first, then the
    checkpoint's sentence-transformers files (``config.model`` must be a local directory),
    then the model class's ``default_pooling_type`` (the last token; the first for
    BERT-like encoders) with normalization (without it for a sequence classifier: its
    vectors are class logits) and the activation on. The checkpoint's ``Dense`` modules are
    read (and, unless ``check_dense_weights`` is false, their weights checked) whatever
    ``pooler_config`` says; a classifier with any is refused (``ValueError``). The runner
    passes ``check_dense_weights=False``: its :class:`~chassis.core.pooler.Pooler` loads the
    weights right after, with the same checks."""
    check_pooler_config(config.pooler_config)
    values: dict[str, Any] = {}
    for key, value in (config.pooler_config or {}).items():
        if value is not None:
            values[_KEY_ALIASES.get(key, key)] = value
    missing = any(key not in values for key in ("pooling_type", "normalize"))
    if missing and config.model is not None:
        st = read_sentence_transformers_pooling(config.model) or {}
        if _is_classifier_dir(config.model):
            st["normalize"] = False  # class logits (a user's pooler_config still wins)
        values = {**st, **values}
    defaults = PoolerConfig(pooling_type=_model_default_pooling_type(config.model))
    return PoolerConfig(
        pooling_type=str(values.get("pooling_type", defaults.pooling_type)).upper(),
        normalize=bool(values.get("normalize", defaults.normalize)),
        use_activation=bool(values.get("use_activation", defaults.use_activation)),
        dense=_dense_modules(config.model, check_weights=check_dense_weights),
    )


def _dense_modules(model_dir: str | Path | None, *, check_weights: bool) -> tuple[ChainSpec, ...]:
    """The checkpoint's ``Dense`` and ``LayerNorm`` modules, checked against its ``hidden_size`` (the pooled
    vector's length), their weights files too when ``check_weights``; none without
    ``modules.json``."""
    if model_dir is None:
        return ()
    modules = read_modules(model_dir)
    if not modules:
        return ()
    specs = read_chain_specs(
        model_dir, modules, _hidden_size(model_dir), check_weights=check_weights
    )
    if specs and _is_classifier_dir(model_dir):
        raise ValueError(
            f"{model_dir}: Dense and LayerNorm modules apply to embedding models; this "
            "checkpoint is a "
            "sequence classifier (its vectors are class logits)"
        )
    return specs


def _hidden_size(model_dir: str | Path) -> int | None:
    """``config.json``'s ``hidden_size`` (or its ``text_config``'s); ``None`` when absent."""
    path = Path(model_dir) / "config.json"
    config = read_json(path) if path.is_file() else None
    if not isinstance(config, dict):
        return None
    size = config.get("hidden_size")
    if size is None and isinstance(config.get("text_config"), dict):
        size = config["text_config"].get("hidden_size")
    return size if isinstance(size, int) else None


def _model_default_pooling_type(model_dir: str | Path | None) -> str:
    """The pooling type the registered model class of the checkpoint in ``model_dir`` uses
    by default (its ``default_pooling_type``: ``"CLS"`` for BERT-like encoders); vLLM's
    default for decoders, ``"LAST"``, without a readable ``config.json``."""
    from chassis.core.pooling_classify import registered_model_attribute

    path = None if model_dir is None else Path(model_dir) / "config.json"
    if path is None or not path.is_file():
        return PoolerConfig.pooling_type
    config = read_json(path)
    architectures = config.get("architectures") if isinstance(config, dict) else None
    return str(
        registered_model_attribute(
            architectures or [], "default_pooling_type", PoolerConfig.pooling_type
        )
    )


def _is_classifier_dir(model_dir: str | Path) -> bool:
    """Whether the checkpoint in ``model_dir`` is a sequence classifier (``config.json``'s
    ``architectures``); ``False`` when there is no readable ``config.json``."""
    from chassis.core.pooling_classify import is_classification_architecture

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return False
    config = read_json(path)
    architectures = config.get("architectures") if isinstance(config, dict) else None
    return is_classification_architecture(architectures or [])


def apply_pooling_defaults(config: EngineConfig) -> PoolerConfig | None:
    """For a pooling engine: resolve its pooling into ``config.pooler_config`` and turn
    prefix caching off when the pooler needs every token's hidden state. Returns the pooling,
    or ``None`` for a generating engine (``config`` untouched). Idempotent.

    ``config.pooler_config`` then holds the pooling type, normalization and activation, so
    a later process resolving the same ``config`` takes them from it without reading the
    sentence-transformers pooling files again. The ``Dense`` modules are not part of it
    (:meth:`PoolerConfig.as_dict`): every resolve reads them from the checkpoint again, and
    their weights are loaded each time. At start that is once in the front end, once in
    the engine core (each with the weights checked: a bad file is refused before the model
    loads) and once per runner, whose :class:`~chassis.core.pooler.Pooler` keeps them."""
    if config.runner != "pooling":
        return None
    pooler = resolve_pooler_config(config)
    config.pooler_config = pooler.as_dict()
    if pooler.needs_every_token and config.enable_prefix_caching:
        logger.info(
            "%s pooling reads every prompt token's hidden state, which a prefix-cache hit "
            "skips: prefix caching is off (last-token pooling keeps it)",
            pooler.pooling_type,
        )
        config.enable_prefix_caching = False
    return pooler
