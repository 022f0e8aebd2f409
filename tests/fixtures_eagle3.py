"""Tiny EAGLE-3 heads in the layout real heads ship (yuhuili ``EAGLE3-*`` / SpecForge: a
Llama ``config.json`` of architecture ``LlamaForCausalLMEagle3`` with ``draft_vocab_size``,
tensors ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight`` over the draft
vocabulary, ``d2t`` and ``t2d``), and :class:`ReferenceEagle3`, the head's drafts computed
from that format in plain torch over HF's target, without the engine's code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def draft_vocabulary(vocab_size: int, draft_vocab_size: int, seed: int = 0) -> torch.Tensor:
    """``draft_vocab_size`` distinct target ids, ascending (a real head's are the target's
    most frequent tokens, kept in id order): draft id ``d`` is target id ``ids[d]``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab_size, generator=generator)[:draft_vocab_size].sort().values


def write_eagle3_head(
    target_dir: Path,
    directory: Path,
    *,
    draft_vocab_size: int | None = 512,
    layer_ids: list[int] | None = None,
    seed: int = 0,
    with_d2t: bool = True,
    target_ids: torch.Tensor | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """A random-weight EAGLE-3 head for the target at ``target_dir``: over ``target_ids``
    (default :func:`draft_vocabulary`) when ``draft_vocab_size`` is set (``None``: the
    target's whole vocabulary, no ``d2t``), reading ``layer_ids`` (``None``: not named in
    its config). ``tensors`` replace the random ones of the same name, ``config_overrides``
    the config's fields."""
    config = json.loads((target_dir / "config.json").read_text())
    hidden = int(config["hidden_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = hidden // heads
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    head_config: dict[str, Any] = {
        **config,
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
    }
    draft_vocab = vocab if draft_vocab_size is None else draft_vocab_size
    if draft_vocab_size is not None:
        head_config["draft_vocab_size"] = draft_vocab_size
    if layer_ids is not None:
        head_config["eagle_aux_hidden_state_layer_ids"] = layer_ids
    head_config.update(config_overrides or {})
    num_aux = 3 if layer_ids is None else len(layer_ids)
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=generator)

    weights = {
        "fc.weight": rand(hidden, num_aux * hidden),
        "midlayer.input_layernorm.weight": 1.0 + rand(hidden),
        "midlayer.hidden_norm.weight": 1.0 + rand(hidden),
        "midlayer.post_attention_layernorm.weight": 1.0 + rand(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": 1.0 + rand(hidden),
        "lm_head.weight": rand(draft_vocab, hidden, scale=1.0),
    }
    if draft_vocab_size is not None and with_d2t:
        ids = draft_vocabulary(vocab, draft_vocab_size, seed) if target_ids is None else target_ids
        weights["d2t"] = ids - torch.arange(draft_vocab_size)  # offsets, as published
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        weights["t2d"] = t2d
    weights.update(tensors or {})
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(head_config))
    save_file(
        {k: v.contiguous() for k, v in weights.items()},
        directory / "model.safetensors",
        metadata={"format": "pt"},
    )
    return directory


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class ReferenceEagle3:
    """The drafts an EAGLE-3 head at ``head_dir`` should propose over the target at
    ``target_dir`` (float32): HF's target with ``output_hidden_states`` (``hidden_states[i]``
    is what enters layer ``i``), and the head written out from the checkpoint format in
    plain torch over whole sequences (no KV cache; HF's rotary tables)."""

    def __init__(self, target_dir: Path, head_dir: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.target = AutoModelForCausalLM.from_pretrained(
            str(target_dir), dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.config = config = AutoConfig.from_pretrained(str(head_dir))
        weights = load_file(head_dir / "model.safetensors")
        self.w = {name.removeprefix("model."): tensor for name, tensor in weights.items()}
        num_layers = int(self.target.config.num_hidden_layers)
        ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
        self.layer_ids = list(ids) if ids else [2, num_layers // 2, num_layers - 3]
        self.eps = float(config.rms_norm_eps)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        self.rotary = LlamaRotaryEmbedding(config)
        vocab = int(config.vocab_size)
        draft_vocab = int(getattr(config, "draft_vocab_size", None) or vocab)
        d2t = self.w.get("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self.to_target = torch.arange(draft_vocab) + d2t

    def _attention(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        w, n = self.w, x.shape[0]
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, self.heads, self.head_dim)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, self.kv_heads, self.head_dim)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, self.kv_heads, self.head_dim)
        cos, sin = self.rotary(x[None], positions[None])
        q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        q, k = q[0], k[0]  # [heads, n, d]
        group = self.heads // self.kv_heads
        k = k.repeat_interleave(group, dim=0)
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        scores = q @ k.transpose(1, 2) * self.head_dim**-0.5
        scores = scores + torch.full((n, n), float("-inf")).triu(1)
        out = scores.softmax(-1) @ v  # [heads, n, d]
        return out.transpose(0, 1).reshape(n, -1) @ w["midlayer.self_attn.o_proj.weight"].T

    def _head(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The head's pre-norm outputs at positions ``0 .. len(tokens) - 1`` reading
        ``tokens[p]`` (the token after position ``p``) and ``hidden[p]``."""
        w, eps = self.w, self.eps
        embeds = self.target.model.embed_tokens.weight[torch.tensor(tokens)]
        attention_in = torch.cat(
            [
                _rms(embeds, w["midlayer.input_layernorm.weight"], eps),
                _rms(hidden, w["midlayer.hidden_norm.weight"], eps),
            ],
            dim=-1,
        )
        residual = hidden + self._attention(attention_in, torch.arange(len(tokens)))
        x = _rms(residual, w["midlayer.post_attention_layernorm.weight"], eps)
        gate = torch.nn.functional.silu(x @ w["midlayer.mlp.gate_proj.weight"].T)
        up = x @ w["midlayer.mlp.up_proj.weight"].T
        return residual + (gate * up) @ w["midlayer.mlp.down_proj.weight"].T

    @torch.inference_mode()
    def drafts(self, sequence: list[int], count: int) -> list[int]:
        """The ``count`` greedy drafts (target ids) after ``sequence`` (whose last token the
        target has not computed yet)."""
        out = self.target(torch.tensor([sequence[:-1]]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in self.layer_ids], dim=-1)
        hidden = aux @ self.w["fc.weight"].T
        tokens = list(sequence[1:])
        drafts: list[int] = []
        for _ in range(count):
            last = self._head(tokens, hidden)[-1]
            logits = _rms(last, self.w["norm.weight"], self.eps) @ self.w["lm_head.weight"].T
            token = int(self.to_target[int(logits.argmax())])
            drafts.append(token)
            tokens.append(token)
            hidden = torch.cat([hidden, last[None]])
        return drafts


def write_mirror_pair(directory: Path) -> tuple[Path, Path]:
    """A bigram target and an EAGLE-3 head that computes it, for acceptance: ``(target,
    head)`` folders.

    The target (one Llama layer, no RoPE scaling) writes nothing into its residual stream
    (``o_proj`` and ``down_proj`` zero): its next token after ``t`` is the argmax of
    ``lm_head . e(t)``, where every embedding row has a root mean square of 1, the same
    first coordinate ``A`` and zeros in its last half. ``lm_head`` favours 256 ids, so the
    next token is always one of them. The head (``norm_before_residual`` with a zero
    ``hidden_norm``: it ignores its hidden input) attends to its own position only (q and k
    are the same constant vector, read from the constant coordinate, on three rotary pairs:
    ``q . R(d) k`` is largest at distance 0 by far), passes the embedding's first half
    through ``v`` and ``o_proj`` (its MLP's ``down_proj`` is zero), and scores its 512-id
    draft vocabulary (those 256 and 256 others) with the target's ``lm_head`` rows: its draft
    after token ``t`` is the target's next token after ``t``, up to attention's leakage."""
    from fixtures_models import write_tiny_checkpoint

    target_dir = write_tiny_checkpoint(
        "llama", directory / "target", num_hidden_layers=1, rope_scaling=None
    )
    config = json.loads((target_dir / "config.json").read_text())
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = hidden // heads
    half, first = hidden // 2, 2.0  # the embedding's live coordinates, its constant one
    generator = torch.Generator().manual_seed(5)
    rest = torch.randn(vocab, half - 1, generator=generator)
    rest = rest * ((hidden - first**2) / rest.pow(2).sum(-1, keepdim=True)).sqrt()
    embed = torch.zeros(vocab, hidden)
    embed[:, 0], embed[:, 1:half] = first, rest
    favoured = torch.randperm(vocab, generator=generator)[:256]
    lm_head = 0.01 * torch.randn(vocab, hidden, generator=generator)
    lm_head[favoured] = torch.randn(256, hidden, generator=generator)
    weights = load_file(target_dir / "model.safetensors")
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = lm_head
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["model.layers.0.self_attn.o_proj.weight"].zero_()
    weights["model.layers.0.mlp.down_proj.weight"].zero_()
    save_file(weights, target_dir / "model.safetensors", metadata={"format": "pt"})

    others = torch.randperm(vocab, generator=generator)
    others = others[~torch.isin(others, favoured)][:256]
    ids = torch.cat([favoured, others]).sort().values
    # q = k = m on the first coordinate of three rotary pairs (0, 1, 2) of every head, read
    # from the constant coordinate of the normed embedding (A / rms = A)
    m = 30.0
    q = torch.zeros(heads * head_dim, 2 * hidden)
    k = torch.zeros(kv_heads * head_dim, 2 * hidden)
    for h in range(heads):
        q[h * head_dim : h * head_dim + 3, 0] = m / first
    for h in range(kv_heads):
        k[h * head_dim : h * head_dim + 3, 0] = m / first
    # v: the embedding's live half, split over the KV heads; o_proj puts it back in place
    v = torch.zeros(kv_heads * head_dim, 2 * hidden)
    v[:half, :half] = torch.eye(half)
    o = torch.zeros(hidden, heads * head_dim)
    group = heads // kv_heads
    for g in range(kv_heads):
        rows = slice(g * head_dim, (g + 1) * head_dim)
        o[rows, g * group * head_dim : (g * group + 1) * head_dim] = torch.eye(head_dim)
    head_dir = write_eagle3_head(
        target_dir,
        directory / "head",
        layer_ids=[0, 0, 0],
        target_ids=ids,
        tensors={
            "midlayer.input_layernorm.weight": torch.ones(hidden),
            "midlayer.hidden_norm.weight": torch.zeros(hidden),
            "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
            "midlayer.self_attn.q_proj.weight": q,
            "midlayer.self_attn.k_proj.weight": k,
            "midlayer.self_attn.v_proj.weight": v,
            "midlayer.self_attn.o_proj.weight": o,
            "midlayer.mlp.down_proj.weight": torch.zeros(hidden, int(config["intermediate_size"])),
            "norm.weight": torch.ones(hidden),
            "lm_head.weight": lm_head[ids],
        },
    )
    head_config = json.loads((head_dir / "config.json").read_text())
    head_config["norm_before_residual"] = True
    (head_dir / "config.json").write_text(json.dumps(head_config))
    return target_dir, head_dir


def write_pytorch_bin_copy(head_dir: Path, directory: Path) -> Path:
    """The head (or any checkpoint) at ``head_dir`` as published heads often ship it: the
    same ``config.json`` and tensors, in one ``pytorch_model.bin`` (``torch.save`` of the
    state dict) instead of ``model.safetensors``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text((head_dir / "config.json").read_text())
    torch.save(load_file(head_dir / "model.safetensors"), directory / "pytorch_model.bin")
    return directory


#: EAGLE-3 fields the speculators layout keeps at the top level of its config.json
_SPECULATORS_TOP_LEVEL = (
    "draft_vocab_size",
    "target_hidden_size",
    "norm_before_residual",
    "eagle_aux_hidden_state_layer_ids",
)


def write_speculators_copy(
    head_dir: Path,
    directory: Path,
    *,
    speculative_tokens: int = 3,
    overrides: dict[str, Any] | None = None,
    safetensors: bool = False,
) -> Path:
    """The yuhuili-layout EAGLE-3 head at ``head_dir`` in RedHatAI's ``speculators`` layout
    (what ``speculators`` saves, e.g. ``RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3``):
    ``config.json`` with ``speculators_model_type: "eagle3"``, the decoder layer's Llama
    config in ``transformer_layer_config``, the EAGLE-3 fields at the top level (a missing
    ``norm_before_residual`` written as the yuhuili layout's default, false) and
    ``speculators_config`` (proposal methods, verifier); tensors named ``layers.0.*`` instead
    of ``midlayer.*``, in ``pytorch_model.bin`` (``safetensors``: ``model.safetensors``).
    ``overrides`` replace top-level keys."""
    head = json.loads((head_dir / "config.json").read_text())
    layer = {k: v for k, v in head.items() if k not in _SPECULATORS_TOP_LEVEL}
    layer.pop("architectures", None)
    layer["architectures"] = ["LlamaForCausalLM"]
    layer.setdefault("model_type", "llama")
    config: dict[str, Any] = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": head.get("draft_vocab_size", head["vocab_size"]),
        "norm_before_residual": head.get("norm_before_residual", False),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": speculative_tokens}
            ],
            "verifier": {"name_or_path": "target", "architectures": ["LlamaForCausalLM"]},
        },
    }
    for key in ("target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if key in head:
            config[key] = head[key]
    config.update(overrides or {})
    weights = {
        name.replace("midlayer.", "layers.0.", 1): tensor
        for name, tensor in load_file(head_dir / "model.safetensors").items()
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if safetensors:
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    else:
        torch.save(weights, directory / "pytorch_model.bin")
    return directory
