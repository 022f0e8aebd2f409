"""StarCoder2: the Llama decoder with LayerNorm, a plain GELU MLP and biases everywhere.

As HF transformers' ``Starcoder2`` code defines it, a layer is Llama's pre-norm layout::

    h = h + o_proj(attn(input_layernorm(h)))
    h = h + c_proj(gelu(c_fc(post_attention_layernorm(h))))

and it differs from Llama in:

- the norms (both per layer and the final one) are ``nn.LayerNorm`` with a bias, over
  ``norm_epsilon`` (:class:`LayerNorm`), not RMSNorm;
- the MLP is not gated: ``c_fc`` -> ``hidden_act`` (``gelu_pytorch_tanh`` in the released
  checkpoints) -> ``c_proj`` (:class:`Starcoder2MLP`);
- ``use_bias`` puts a bias on q/k/v/o and on ``c_fc``/``c_proj`` (true in every released
  checkpoint);
- ``sliding_window`` applies to every layer when set (starcoder2-3b/7b/15b: 4096), as for
  Mistral;
- the LM head is tied to the embedding unless ``tie_word_embeddings`` is false.

Attention (merged ``qkv_proj``), RoPE, weight loading by HF names and tensor-parallel
sharding are :class:`LlamaForCausalLM`'s; ``c_fc`` is cut by rows (column parallel) and
``c_proj`` by columns (row parallel, its bias added by rank 0 only), as Llama cuts
``up_proj`` and ``down_proj``. Dropouts (``attention_dropout``, ``residual_dropout``,
``embedding_dropout``) are training-only and do nothing at inference, as in HF.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaForCausalLM
from chassis.core import parallel_state
from chassis.core.layers.activation import GELU_APPROXIMATIONS
from chassis.core.layers.norm import RMSNorm
from chassis.core.model_interface import LoRASlice, ModelBuildContext

#: StarCoder2's MLP projections -> the Llama projection each is sharded like
_MLP_SHARDED_AS = {"c_fc": "up_proj", "c_proj": "down_proj"}


class LayerNorm(RMSNorm):
    """``nn.LayerNorm`` (mean and variance over the last dimension, then ``weight`` and an
    optional ``bias``), called as :class:`RMSNorm` is so that the Llama decoder can use it:
    ``norm(x)`` and ``norm(x, residual)`` returning ``(norm(x + residual), x + residual)``.

    Only the calls are shared: it computes a layer norm, with ``F.layer_norm`` in the input
    dtype as HF's ``nn.LayerNorm`` does, and always runs this torch code (the platforms'
    ``rms_norm`` kernels compute RMSNorm's formula).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(hidden_size, eps)
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # never the platform kernel: it would compute RMSNorm's formula
        return self.forward_reference(x, residual)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bias={self.bias is not None}"


class Starcoder2MLP(nn.Module):
    """``c_proj(gelu(c_fc(x)))``, with biases when ``spec.mlp_bias``.

    ``c_fc`` holds this rank's ``spec.intermediate_size`` rows, ``c_proj`` the matching
    columns; the output is summed over the tensor-parallel group.
    """

    def __init__(self, spec: DecoderSpec, gelu_approximate: str) -> None:
        super().__init__()
        self.c_fc = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.c_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.gelu_approximate = gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.c_fc(x), approximate=self.gelu_approximate)
        # Each rank holds some columns of the MLP: c_proj's partial sums add up.
        return parallel_state.all_reduce(self.c_proj(hidden))

    def extra_repr(self) -> str:
        return f"approximate={self.gelu_approximate!r}"


def starcoder2_gelu_approximate(hf_config: Any) -> str:
    """``F.gelu``'s ``approximate`` for the config's ``hidden_act`` (``gelu_pytorch_tanh``:
    ``"tanh"``; ``gelu``: ``"none"``); a ``ValueError`` naming ``hidden_act`` otherwise."""
    activation = getattr(hf_config, "hidden_act", "gelu_pytorch_tanh")
    if activation not in GELU_APPROXIMATIONS:
        raise ValueError(
            f"StarCoder2 hidden_act {activation!r} is not supported; supported: "
            f"{', '.join(GELU_APPROXIMATIONS)}"
        )
    return GELU_APPROXIMATIONS[activation]


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """``Starcoder2ForCausalLM`` checkpoints (bigcode/starcoder2-3b, -7b, -15b and their
    fine-tunes).

    :class:`LayerNorm` for every norm, :class:`Starcoder2MLP` for every MLP, Llama's
    attention with ``use_bias`` on q/k/v/o and ``sliding_window`` on every layer. Tensor
    parallelism and LoRA adapters follow Llama's cuts (``c_fc`` as ``up_proj``, ``c_proj``
    as ``down_proj``).
    """

    norm_class = LayerNorm
    #: only q/k/v are merged; ``c_fc`` and ``c_proj`` load under their own names
    merged_projections = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
    lora_merged_projections = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Llama's fields with ``norm_epsilon`` as the norms' eps and ``use_bias`` for every
        projection; ``hidden_act`` must be a GELU (:func:`starcoder2_gelu_approximate`)."""
        starcoder2_gelu_approximate(hf_config)
        use_bias = bool(getattr(hf_config, "use_bias", True))
        return DecoderSpec.from_config(
            hf_config,
            activation=None,  # a GELU, checked above
            rms_norm_eps=float(getattr(hf_config, "norm_epsilon", 1e-5)),
            qkv_bias=use_bias,
            o_bias=use_bias,
            mlp_bias=use_bias,
        )

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> nn.Module:
        self.gelu_approximate = starcoder2_gelu_approximate(hf_config)
        return super().build_decoder(hf_config, build_ctx)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        return Starcoder2MLP(self.spec, self.gelu_approximate)

    def _tensor_parallel_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """As :class:`LlamaForCausalLM`'s, with ``c_fc`` cut as ``up_proj`` (rows, bias
        too) and ``c_proj`` as ``down_proj`` (columns; its bias whole on rank 0, zeros on
        the others)."""
        return super()._tensor_parallel_slice(_sharded_as(name), tensor)

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        """As Llama's; ``c_fc``/``c_proj`` slices report the whole projection's shape (Llama
        knows them by their Llama names only)."""
        slices = super().lora_slices(module_name, module)
        tp = parallel_state.tp_size()
        leaf = module_name.rpartition(".")[2]
        if tp == 1 or leaf not in _MLP_SHARDED_AS:
            return slices
        if leaf == "c_fc":  # rows cut
            return [s._replace(out_features=s.rows * tp) for s in slices]
        return [s._replace(in_features=s.in_features * tp) for s in slices]  # columns cut

    def lora_shard(
        self, hf_module: str, lora_a: torch.Tensor, lora_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the projection's weight is cut: B's rows for ``c_fc``, A's columns for
        ``c_proj``; the attention projections as Llama's."""
        leaf = hf_module.rpartition(".")[2]
        if leaf not in _MLP_SHARDED_AS:
            return super().lora_shard(hf_module, lora_a, lora_b)
        weight_name = f"{hf_module}.weight"
        if leaf == "c_fc":
            return lora_a, self._tensor_parallel_slice(weight_name, lora_b)
        return self._tensor_parallel_slice(weight_name, lora_a), lora_b


def _sharded_as(name: str) -> str:
    """``...mlp.c_fc.weight`` -> ``...mlp.up_proj.weight`` (and ``c_proj`` -> ``down_proj``):
    the Llama name whose tensor-parallel cut applies; other names as they are."""
    parts = name.split(".")
    if len(parts) > 1 and parts[-2] in _MLP_SHARDED_AS:
        return ".".join([*parts[:-2], _MLP_SHARDED_AS[parts[-2]], parts[-1]])
    return name
