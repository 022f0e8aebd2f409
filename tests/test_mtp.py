"""Multi-token-prediction speculative decoding (core/mtp.py, ``--speculative-config``
``{"method": "mtp", "num_speculative_tokens": k}``) over tiny random DeepSeek-V3 and
GLM-4.5 checkpoints whose MTP layer (``model.layers.2.*``: HF does not write one) is added
here in the published layout.

- The head's logits equal a plain torch reference of the MTP module (HF's decoder layer
  of the target's kind, enorm/hnorm/eh_proj/shared_head by hand) on the same inputs.
- Greedy output with MTP drafting (k = 1 and 2) is plain decoding's token for token; drafts
  are proposed and counted. A "mirror" MTP layer over a near-bigram target (its layers'
  output projections scaled down) predicts the target's next token, and most of its drafts
  are accepted.
- Every proposal equals the reference module's over the whole sequence; seeded random
  requests keep plain decoding's tokens, unseeded ones accept probabilistic drafts.
- A checkpoint without MTP layers, and a config naming a ``model``, are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import new_kv_caches
from safetensors.torch import load_file, save_file
from spec_decode_helpers import ENGINE, PROMPTS, greedy, record_proposals, token_ids
from test_deepseek_models import write_checkpoint as write_deepseek
from test_glm4_moe_model import write_checkpoint as write_glm

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.core.attention import ForwardContext
from chassis.core.config import EngineConfig
from chassis.core.speculative import SpeculativeConfig

MTP = "model.layers.2."  # the tiny checkpoints have 2 decoder layers


def _rand(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return 0.1 * torch.randn(*shape, generator=generator)


def add_mtp_layer(model_dir: Path, mirror: bool, seed: int = 5) -> Path:
    """Write ``model.layers.2.*`` into the checkpoint (and ``num_nextn_predict_layers`` 1).

    Random: the decoder layer is layer 1's (a mixture of experts) plus noise, the MTP
    tensors random. Mirror: the target's attention and MLP outputs are scaled by 0.01 (the
    target is almost a function of the current token), the MTP layer reads the token
    embedding only (``eh_proj = [I, 0]``) and ends in the target's final norm and LM head:
    at position ``p`` it predicts the target's token after ``token[p + 1]``."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    hidden = tensors["model.norm.weight"].shape[0]
    if mirror:
        for name in list(tensors):
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = 0.01 * tensors[name]
    for name in [n for n in tensors if n.startswith("model.layers.1.")]:
        tensor = tensors[name]
        if not mirror:
            tensor = tensor + _rand(generator, *tensor.shape)
        tensors[MTP + name.removeprefix("model.layers.1.")] = tensor.clone()
    if mirror:
        own = {
            "enorm.weight": torch.ones(hidden),
            "hnorm.weight": torch.ones(hidden),
            "eh_proj.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1),
            "shared_head.norm.weight": tensors["model.norm.weight"].clone(),
            "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        }
    else:
        own = {
            "enorm.weight": 1.0 + _rand(generator, hidden),
            "hnorm.weight": 1.0 + _rand(generator, hidden),
            "eh_proj.weight": _rand(generator, hidden, 2 * hidden),
            "shared_head.norm.weight": 1.0 + _rand(generator, hidden),
            "shared_head.head.weight": _rand(generator, *tensors["lm_head.weight"].shape),
        }
    own["embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors.update({MTP + k: v.contiguous() for k, v in own.items()})
    save_file(tensors, path, metadata={"format": "pt"})
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return model_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for kind, write in (("v3", lambda d: write_deepseek("v3", d)), ("glm", write_glm)):
        for mode in ("random", "mirror"):
            directory = write(tmp_path_factory.mktemp(f"mtp_{kind}_{mode}"))
            dirs[f"{kind}_{mode}"] = add_mtp_layer(directory, mirror=mode == "mirror")
    return dirs


def mtp_llm(model_dir: Path, k: int | None, **engine: Any) -> LLM:
    settings: dict[str, Any] = dict(ENGINE)
    if k is not None:
        settings["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    return LLM(str(model_dir), **{**settings, **engine})


class ReferenceMtp:
    """The MTP module of ``model_dir`` in plain torch over a whole sequence, no KV cache:
    HF's decoder layer of the target's kind (layer index 2: a mixture of experts) filled
    with the checkpoint's ``model.layers.2.*`` tensors."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation="eager"
        ).eval()
        config = AutoConfig.from_pretrained(str(model_dir))
        config._attn_implementation = "eager"
        decoder = self.target.model
        layer_cls = type(decoder.layers[1])
        self.layer = layer_cls(config, 2).eval()
        weights = load_file(model_dir / "model.safetensors")
        mtp = {k.removeprefix(MTP): v for k, v in weights.items() if k.startswith(MTP)}
        own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.", "mlp.experts.")
        state = {k: v for k, v in mtp.items() if not k.startswith(own)}
        # HF keeps the experts stacked ([E, gate ‖ up, hidden] and [E, hidden, inter]);
        # checkpoints hold them one by one
        num_experts = int(config.n_routed_experts)
        expert = "mlp.experts.{}.{}.weight"
        state["mlp.experts.gate_up_proj"] = torch.stack(
            [
                torch.cat([mtp[expert.format(e, "gate_proj")], mtp[expert.format(e, "up_proj")]])
                for e in range(num_experts)
            ]
        )
        state["mlp.experts.down_proj"] = torch.stack(
            [mtp[expert.format(e, "down_proj")] for e in range(num_experts)]
        )
        self.layer.load_state_dict(state)
        self.mtp = mtp
        self.rotary = decoder.rotary_emb
        self.eps = float(config.rms_norm_eps)

    def _norm(self, x: torch.Tensor, weight: str) -> torch.Tensor:
        rms = x.pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
        return x * rms * self.mtp[weight]

    @torch.inference_mode()
    def logits(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The module's logits at positions ``0 .. len(tokens) - 1``, reading ``tokens[p]``
        (the token after ``p``) and ``hidden[p]``."""
        return self.head_logits(self.outputs(tokens, hidden))

    def head_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self._norm(out, "shared_head.norm.weight") @ self.mtp["shared_head.head.weight"].T

    @torch.inference_mode()
    def drafts(self, sequence: list[int], count: int) -> list[int]:
        """The ``count`` greedy drafts after ``sequence`` (whose last token the target has
        not computed yet): the target's final hidden states of all but that token, then the
        module step by step on its own outputs."""
        hidden = self.target.model(torch.tensor([sequence[:-1]])).last_hidden_state[0]
        tokens = list(sequence[1:])
        drafts: list[int] = []
        for _ in range(count):
            out = self.outputs(tokens, hidden)
            drafts.append(int(self.head_logits(out[-1:]).argmax()))
            tokens.append(drafts[-1])
            hidden = torch.cat([hidden, out[-1:]])
        return drafts

    @torch.inference_mode()
    def outputs(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The module's outputs (before ``shared_head.norm``), as :meth:`logits`."""
        embeds = self.target.model.embed_tokens(torch.tensor(tokens))
        embeds[0] = 0.0  # position 0
        x = torch.cat([self._norm(embeds, "enorm.weight"), self._norm(hidden, "hnorm.weight")], -1)
        x = (x @ self.mtp["eh_proj.weight"].T)[None]
        positions = torch.arange(len(tokens))[None]
        mask = torch.full((len(tokens), len(tokens)), float("-inf")).triu(1)[None, None]
        out = self.layer(
            x,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=self.rotary(x, positions),
        )
        return (out[0] if isinstance(out, tuple) else out)[0]


@pytest.mark.parametrize("kind", ["v3", "glm"])
def test_head_logits_match_a_torch_reference(kind: str, checkpoints: dict[str, Path]) -> None:
    """The loaded head's logits over a prefill of 11 positions (its own KV cache, the
    target's final hidden states from HF) equal the reference module's to 1e-4."""
    from fixtures_models import make_attention_metadata

    from chassis.core.model_loader import build_model, load_hf_config
    from chassis.core.mtp import load_mtp_head

    model_dir = checkpoints[f"{kind}_random"]
    config = EngineConfig(
        model=str(model_dir), speculative_config={"method": "mtp", "num_speculative_tokens": 1}
    )
    target = build_model(
        config, load_hf_config(model_dir), model_dir, TorchPagedAttention, "cpu", torch.float32
    )
    layers = target.model.layers
    before = {name: p.clone() for name, p in target.named_parameters()}
    head = load_mtp_head(config, target, TorchPagedAttention, torch.device("cpu"), torch.float32)
    # the head's layer loads through the target's loader without touching the target
    assert target.model.layers is layers and len(layers) == target.hf_config.num_hidden_layers
    for name, p in target.named_parameters():
        assert torch.equal(p, before[name]), name
    reference = ReferenceMtp(model_dir)
    sequence = [5, 900, 77, 31000, 12, 4, 4, 8000, 615, 49000, 3, 270]
    with torch.inference_mode():
        hidden = reference.target.model(torch.tensor([sequence[:-1]])).last_hidden_state[0]
    tokens = sequence[1:]
    n, block_size = len(tokens), 4
    metadata = make_attention_metadata([n], [n], [[0, 1, 2]], block_size)
    caches = new_kv_caches(head.hf_config, 4, block_size)
    with torch.inference_mode():
        out = head(torch.tensor(tokens), torch.arange(n), ForwardContext(metadata, caches), hidden)
        got = head.compute_logits(out)
    want = reference.logits(tokens, hidden)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["v3", "glm"])
def test_greedy_output_is_plain_decoding(kind: str, checkpoints: dict[str, Path]) -> None:
    """k = 1 and 2, chunked prefill (16 tokens a step): plain decoding's tokens with the
    random and the mirror MTP layer; drafts proposed; the mirror's mostly accepted."""
    for mode in ("random", "mirror"):
        model_dir = checkpoints[f"{kind}_{mode}"]
        plain = mtp_llm(model_dir, None)
        try:
            expected = token_ids(plain, greedy())
        finally:
            plain.shutdown()
        for k in (1, 2):
            llm = mtp_llm(model_dir, k, max_num_batched_tokens=16)
            try:
                assert token_ids(llm, greedy()) == expected, (mode, k)
                stats = llm.engine.scheduler.stats()
                drafted, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
                assert drafted > 0 and 0 <= accepted <= drafted
                if mode == "mirror":
                    assert accepted > drafted / 2, (k, accepted, drafted)
            finally:
                llm.shutdown()


@pytest.mark.parametrize("kind", ["v3", "glm"])
def test_drafts_are_the_modules_own(kind: str, checkpoints: dict[str, Path]) -> None:
    """k = 2, chunked prefill: every proposal (after accepted and rejected drafts) equals
    the reference module's over the request's whole sequence: the head's KV cache,
    positions, tokens and hidden states line up."""
    model_dir = checkpoints[f"{kind}_random"]
    llm = mtp_llm(model_dir, 2, max_num_batched_tokens=16)
    seen = record_proposals(llm.engine.executor.worker.runner.drafter)
    try:
        llm.generate(PROMPTS[1:4], greedy(12))
    finally:
        llm.shutdown()
    reference = ReferenceMtp(model_dir)
    assert len(seen) > 8
    for sequence, drafts in seen:
        assert drafts == reference.drafts(sequence, len(drafts))


def test_random_requests_keep_the_distribution_and_seeded_ones_their_tokens(
    checkpoints: dict[str, Path],
) -> None:
    """The mirror DeepSeek-V3 MTP layer, k = 2: a seeded random request gets plain
    decoding's tokens; unseeded ones get probabilistic drafts, some accepted."""
    model_dir = checkpoints["v3_mirror"]
    seeded = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=7)
    plain = mtp_llm(model_dir, None)
    try:
        want = token_ids(plain, seeded)
    finally:
        plain.shutdown()
    llm = mtp_llm(model_dir, 2)
    try:
        assert token_ids(llm, seeded) == want
        before = llm.engine.scheduler.stats().spec_num_accepted_tokens
        outs = token_ids(llm, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
        assert all(len(o) == 16 for o in outs)
        assert llm.engine.scheduler.stats().spec_num_accepted_tokens > before
    finally:
        llm.shutdown()


def test_a_checkpoint_without_mtp_layers_is_refused(tmp_path: Path) -> None:
    """``num_nextn_predict_layers`` 0, or a config that says 1 over a checkpoint without the
    layer's tensors (what HF's ``save_pretrained`` writes): a ``ValueError`` naming it."""
    none = write_deepseek("v3", tmp_path / "none", num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        mtp_llm(none, 1)
    stripped = write_deepseek("v3", tmp_path / "stripped")  # the config's default: 1
    with pytest.raises(ValueError, match=r"no model\.layers\.2\.eh_proj\.weight"):
        mtp_llm(stripped, 1)


def test_the_method_names() -> None:
    """vLLM's older names mean ``mtp``; ``mtp`` takes no ``model``."""
    for name in ("mtp", "deepseek_mtp", "glm4_moe_mtp"):
        spec = SpeculativeConfig.from_value({"method": name, "num_speculative_tokens": 3})
        assert spec.method == "mtp" and spec.uses_mtp and spec.uses_draft_model
    with pytest.raises(ValueError, match="takes no"):
        SpeculativeConfig.from_value({"method": "mtp", "model": "x"})
