"""Tiny EAGLE-1 heads in the layout real heads ship (yuhuili ``EAGLE-*``: a Llama
``config.json`` and ``fc.*`` / ``layers.N.*`` tensors, no ``model.`` prefix, no embedding
or LM head of their own), and a one-layer target a head can mirror."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from fixtures_models import write_tiny_checkpoint
from safetensors.torch import load_file, save_file


def write_mirror_target(directory: Path) -> Path:
    """A tiny one-layer Llama whose first input norm is (almost) the identity on its
    embeddings: every embedding row has a root mean square of 1 and the norm's weights are
    1 (eps 1e-6). Its final norm's weights are 1 too, so its argmax is that of the LM head
    over the un-normed state (the norm only scales it)."""
    write_tiny_checkpoint("llama", directory, num_hidden_layers=1, rms_norm_eps=1e-6)
    path = directory / "model.safetensors"
    weights = load_file(path)
    embed = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    weights["model.layers.0.input_layernorm.weight"] = torch.ones_like(
        weights["model.layers.0.input_layernorm.weight"]
    )
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    save_file(weights, path, metadata={"format": "pt"})
    return directory


def _write_head(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    head_config = {**config, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}
    (directory / "config.json").write_text(json.dumps(head_config))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        directory / "model.safetensors",
        metadata={"format": "pt"},
    )
    return directory


def write_mirror_head(target_dir: Path, directory: Path) -> Path:
    """An EAGLE head that recomputes :func:`write_mirror_target`'s next token: ``fc`` keeps
    the token embedding and drops the hidden state, and its layer is the target's layer
    (the head's missing first input norm is the target's identity-like one). At position
    ``p`` it so computes the target's state at ``p + 1`` from tokens ``1 .. p + 1`` (the
    target also attends to token 0: the drafts are nearly, not always, the target's)."""
    config = json.loads((target_dir / "config.json").read_text())
    weights = load_file(target_dir / "model.safetensors")
    hidden = int(config["hidden_size"])
    tensors = {
        "fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
        "fc.bias": torch.zeros(hidden),
    }
    for name, tensor in weights.items():
        if name.startswith("model.layers.0.") and "input_layernorm" not in name:
            tensors[name.removeprefix("model.")] = tensor
    return _write_head(directory, config, tensors)


def write_random_head(
    target_dir: Path, directory: Path, seed: int = 0, hidden_size: int | None = None
) -> Path:
    """An EAGLE head of random weights (no ``fc.bias``) shaped for the target, or with
    another ``hidden_size``."""
    config = json.loads((target_dir / "config.json").read_text())
    if hidden_size is not None:
        config = {**config, "hidden_size": hidden_size}
        config.pop("head_dim", None)  # derived from hidden_size again
    hidden = int(config["hidden_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = hidden // heads
    inter = int(config["intermediate_size"])
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return 0.1 * torch.randn(*shape, generator=generator)

    tensors = {
        "fc.weight": rand(hidden, 2 * hidden),
        "layers.0.self_attn.q_proj.weight": rand(heads * head_dim, hidden),
        "layers.0.self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
        "layers.0.self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
        "layers.0.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": rand(inter, hidden),
        "layers.0.mlp.up_proj.weight": rand(inter, hidden),
        "layers.0.mlp.down_proj.weight": rand(hidden, inter),
        "layers.0.post_attention_layernorm.weight": 1.0 + rand(hidden),
    }
    return _write_head(directory, config, tensors)


class ReferenceHead:
    """An EAGLE-1 head computed with HF's Llama layer over a whole sequence, no KV cache: the
    drafts a head at ``head_dir`` should propose over the target at ``target_dir`` (float32).
    """

    def __init__(self, target_dir: Path, head_dir: Path) -> None:
        """(The head reads the target's embedding table as it is stored, unscaled: a target
        that scales its embeddings, as Gemma does, scales them in its own forward only.)"""
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )

        self.target = AutoModelForCausalLM.from_pretrained(
            str(target_dir), dtype=torch.float32, attn_implementation="eager"
        ).eval()
        config = AutoConfig.from_pretrained(str(head_dir))
        config._attn_implementation = "eager"
        weights = load_file(head_dir / "model.safetensors")
        hidden = int(config.hidden_size)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=True)
        self.fc.weight.data.copy_(weights["fc.weight"])
        self.fc.bias.data.copy_(weights.get("fc.bias", torch.zeros(hidden)))
        self.layer = LlamaDecoderLayer(config, 0).eval()
        layer_weights = {
            k.removeprefix("layers.0."): v for k, v in weights.items() if k.startswith("layers.0.")
        }
        self.layer.input_layernorm = torch.nn.Identity()
        self.layer.load_state_dict(layer_weights)
        self.rotary = LlamaRotaryEmbedding(config)

    @torch.inference_mode()
    def _head(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The head's outputs at positions ``0 .. len(tokens) - 1`` reading ``tokens[p]`` (the
        token after position ``p``) and ``hidden[p]``."""
        ids = torch.tensor([tokens])
        embeds = torch.nn.functional.embedding(ids, self.target.model.embed_tokens.weight)
        x = self.fc(torch.cat([embeds, hidden[None]], dim=-1))
        positions = torch.arange(len(tokens))[None]
        mask = torch.full((len(tokens), len(tokens)), float("-inf")).triu(1)[None, None]
        out = self.layer(
            x,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=self.rotary(x, positions),
        )
        out = out[0] if isinstance(out, tuple) else out
        return out[0]

    @torch.inference_mode()
    def drafts(self, sequence: list[int], count: int) -> list[int]:
        """The ``count`` greedy drafts after ``sequence`` (whose last token the target has
        not computed yet): the target's final hidden states of all but that token, then the
        head step by step on its own outputs."""
        ids = torch.tensor([sequence[:-1]])
        hidden = self.target.model(ids).last_hidden_state[0]
        tokens = list(sequence[1:])
        drafts: list[int] = []
        for _ in range(count):
            out = self._head(tokens, hidden)
            token = int(self.target.lm_head(out[-1]).argmax())
            drafts.append(token)
            tokens.append(token)
            hidden = torch.cat([hidden, out[-1:]])
        return drafts
