"""``PoolingParams``: how one pooling request's vector is finished (vLLM's class and names)."""

from __future__ import annotations

import msgspec

from chassis.core.sampling_params import is_integer

_INT64_MAX = 2**63 - 1


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request settings of a pooling (embedding) request, validated on construction.

    ``dimensions``: keep the vector's first ``dimensions`` values (Matryoshka truncation,
    only for models trained for it; the front-end checks the model), then normalize.
    ``normalize``: L2-normalize the vector; ``None`` = the engine's pooler config (normalized
    unless the checkpoint's sentence-transformers pipeline has no ``Normalize`` module).
    ``truncate_prompt_tokens``: keep the prompt's last ``k`` tokens; ``-1`` = the last
    ``max_model_len``. ``use_activation`` (classification models): pass the class logits
    through the model's activation (softmax, or sigmoid for one label); ``None`` = the
    engine's pooler config (on unless turned off). Invalid values raise ``ValueError`` naming
    the field.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"invalid pooling parameter {field}: {why}")

        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None:
                if not is_integer(value):
                    raise bad(name, f"must be an integer, got {value!r}")
                setattr(self, name, int(value))
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise bad(name, f"must be true or false, got {value!r}")
        if self.dimensions is not None and not 1 <= self.dimensions <= _INT64_MAX:
            raise bad("dimensions", f"must be >= 1, got {self.dimensions}")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and not (truncate == -1 or 1 <= truncate <= _INT64_MAX):
            raise bad(
                "truncate_prompt_tokens", f"must be -1 (fit the context) or >= 1, got {truncate}"
            )

    def clone(self, **changes: object) -> PoolingParams:
        """A copy with ``changes`` applied (and validated)."""
        return msgspec.structs.replace(self, **changes)
