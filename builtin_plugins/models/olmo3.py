"""OLMo 3: OLMo 2's decoder with sliding-window attention on some layers and RoPE per layer
type.

As HF transformers' ``Olmo3`` code defines it, a layer is OLMo 2's (see
:mod:`~chassis.builtin_plugins.models.olmo2`): no norm before attention or the MLP, each
block's output normalized before the residual add, and one RMSNorm over the whole q and k
projections before RoPE. What differs from Llama beyond that:

- ``layer_types`` names each layer ``"sliding_attention"`` (it sees the last
  ``sliding_window`` positions, its own included) or ``"full_attention"``; without it, every
  fourth layer is full and the others slide (HF's default).
- RoPE parameters are per layer type: ``rope_parameters = {"sliding_attention": {...},
  "full_attention": {...}}`` (transformers 5). A legacy ``rope_scaling`` (OLMo 3's YaRN) scales
  only the full layers; the sliding layers rotate by plain ``rope_theta`` (HF's
  ``Olmo3Config.convert_rope_params_to_dict``).
- The MLP never has biases (``attention_bias`` still sets q/k/v/o biases).

Weights, merged projections and tensor parallelism (the projection norms' all-reduce
included) are :class:`~chassis.builtin_plugins.models.olmo2.Olmo2ForCausalLM`'s.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from chassis.builtin_plugins.models.llama import DecoderSpec, config_sliding_window
from chassis.builtin_plugins.models.olmo2 import Olmo2ForCausalLM, Olmo2Model
from chassis.core.layers.rotary import rope_parameters
from chassis.core.model_interface import ModelBuildContext

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
#: HF's Olmo3Config default: every fourth layer full, the others sliding
_FULL_EVERY = 4
#: Olmo3Config's RoPE base when the config names none
_DEFAULT_THETA = 500_000.0


def olmo3_layer_types(hf_config: Any) -> tuple[str, ...]:
    """Each layer's attention kind: ``config.layer_types``, else HF's default pattern. A
    ``ValueError`` names ``layer_types`` when its length or an entry is wrong."""
    num_layers = int(hf_config.num_hidden_layers)
    layer_types = tuple(
        getattr(hf_config, "layer_types", None)
        or (
            FULL_ATTENTION if (i + 1) % _FULL_EVERY == 0 else SLIDING_ATTENTION
            for i in range(num_layers)
        )
    )
    if len(layer_types) != num_layers:
        raise ValueError(
            f"config layer_types has {len(layer_types)} entries for {num_layers} layers "
            "(num_hidden_layers); fix config.json"
        )
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(
            f"config layer_types has unsupported entries {unknown}; supported: "
            f"{', '.join(LAYER_TYPES)}"
        )
    return layer_types


def olmo3_rope_by_layer_type(hf_config: Any) -> dict[str, dict[str, Any]]:
    """RoPE parameters (:func:`~chassis.core.layers.rotary.rope_parameters`' form) of each
    layer type.

    transformers 5 nests them by layer type (its config converts a legacy ``rope_theta`` and
    ``rope_scaling``); each entry is read as a whole config's would be (defaults for
    ``yarn``'s ``factor`` and ``original_max_position_embeddings`` included). A config object
    with one flat set (not from transformers 5) is converted as transformers 5.x converts a
    legacy config.json: the set goes to the full layers, and the sliding layers get plain
    RoPE of HF's default base 500,000 (the legacy ``rope_theta`` reaches only the full
    layers there; OLMo 3's checkpoints use 500,000 anyway).
    """
    nested = getattr(hf_config, "rope_parameters", None)
    max_position = int(getattr(hf_config, "max_position_embeddings", 2048))
    if isinstance(nested, dict) and any(kind in nested for kind in LAYER_TYPES):
        return {
            kind: rope_parameters(
                SimpleNamespace(
                    rope_parameters={"rope_theta": _DEFAULT_THETA, **(nested.get(kind) or {})},
                    max_position_embeddings=max_position,
                )
            )
            for kind in LAYER_TYPES
        }
    full = rope_parameters(hf_config)
    flat = nested if isinstance(nested, dict) else {}
    if "rope_theta" not in flat and not getattr(hf_config, "rope_theta", None):
        full["rope_theta"] = _DEFAULT_THETA
    sliding = {"rope_type": "default", "rope_theta": _DEFAULT_THETA}
    if full.get("partial_rotary_factor") is not None:
        sliding["partial_rotary_factor"] = full["partial_rotary_factor"]
    return {FULL_ATTENTION: full, SLIDING_ATTENTION: sliding}


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """``Olmo3ForCausalLM`` checkpoints (Olmo-3-1025-7B, Olmo-3-1125-32B and their Instruct
    and Think versions).

    OLMo 2's layers (:class:`~chassis.builtin_plugins.models.olmo2.Olmo2Attention` honours
    the layer's window); the sliding layers need an attention backend with windows. Another
    ``hidden_act`` than ``silu``, a RoPE type :class:`~chassis.core.layers.rotary.RotaryEmbedding`
    does not implement, and ``layer_types`` entries other than full/sliding attention are
    refused when the model is built.
    """

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        layer_types = olmo3_layer_types(hf_config)
        return DecoderSpec.from_config(
            hf_config,
            rope=olmo3_rope_by_layer_type(hf_config)[FULL_ATTENTION],
            mlp_bias=False,
            sliding_window=config_sliding_window(hf_config),
            sliding_layers=frozenset(
                i for i, kind in enumerate(layer_types) if kind == SLIDING_ATTENTION
            ),
        )

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> Olmo2Model:
        rope = olmo3_rope_by_layer_type(hf_config)
        return Olmo2Model(
            hf_config,
            self.spec,
            build_ctx,
            self.make_layer,
            rope_per_layer=[rope[kind] for kind in olmo3_layer_types(hf_config)],
        )
