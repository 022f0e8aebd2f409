"""More multimodal checkpoints on text prompts — LLaVA-style (Aya Vision over Cohere2; its images: tests/test_aya_vision_images.py), GLM-4.1V, GLM-4.5V
(their images: tests/test_glm4v_images.py), Ministral 3 inside Mistral 3, a LLaVA checkpoint
with a DINOv2 tower (served as text only) — and text-only Ministral 3, against HF
transformers' models on tiny random checkpoints.

Each checkpoint is the HF class built from a config with a 2-layer, hidden-64 text model and a
1-layer vision tower, random float32 weights (1-D parameters and the routers' correction
biases randomized too), saved with ``save_pretrained``. HF runs text-only ``input_ids`` with
its own position handling; float32 logits must match (batched prefill, a decode, a chunk over
a cached prefix) and greedy tokens through ``LLM`` must be HF ``generate``'s. The GLM
M-RoPE rotations of text positions are checked against chassis' RoPE, the text-only LLaVA's
vision tensors are never read, and Ministral 3's query scaling is shown to matter. LLaVA-1.5 (over Llama),
LLaVA-NeXT (over Mistral) and InternVL (over Qwen3), which take images
(tests/test_llava_images.py, tests/test_llava_next_images.py, tests/test_internvl_images.py),
are checked here on text prompts too.
"""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_aya_vision import scale_logits
from fixtures_models import TINY_CONFIG_FIELDS, allocate_block_tables, hf_greedy_tokens
from safetensors.torch import load_file
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import Runner, hf_logits
from test_multimodal_text_models import check_parity_with
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.models.glm4 import Glm4ForCausalLM
from chassis.builtin_plugins.models.llava import LlavaForConditionalGeneration
from chassis.builtin_plugins.models.llava_images import LlavaForConditionalGenerationWithImages
from chassis.builtin_plugins.models.ministral3 import Llama4ScaledAttention
from chassis.builtin_plugins.models.text_only import TextOnlyWeights
from chassis.core import model_loader
from chassis.core.gguf_checkpoint import embedded_model_dir
from chassis.core.layers.rotary import RotaryEmbedding, rope_parameters
from chassis.core.model_loader import load_hf_config, model_class
from chassis.core.tokenizer import load_tokenizer

ARCHITECTURES = (
    "llava",
    "llava_dinov2",
    "llava_next",
    "internvl",
    "aya_vision",
    "glm4v",
    "glm4v_moe",
    "mistral3_ministral3",
    "ministral3",
)
#: the image side's checkpoint-name prefixes as transformers 5 saves them (the hub's layout),
#: for the checkpoints served as text only (LLaVA with a DINOv2 tower)
#: (LLaVA-1.5, LLaVA-NeXT, InternVL and Aya Vision read their image side:
#: tests/test_llava_images.py, tests/test_llava_next_images.py, tests/test_internvl_images.py,
#: tests/test_aya_vision_images.py)
VISION_PREFIXES = {
    "llava_dinov2": ("vision_tower.", "multi_modal_projector."),
    # (Mistral 3 reads its image side: tests/test_mistral3_images.py; GLM-4.1V and GLM-4.5V
    # theirs: tests/test_glm4v_images.py)
}
#: GLM's M-RoPE over the 4 rotary frequencies of a head of 16 with partial factor 0.5
_GLM_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "mrope_section": [2, 1, 1],
    "partial_rotary_factor": 0.5,
}
_GLM_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "image_size": 28,
    "patch_size": 14,
}
#: Ministral 3's YaRN and query scaling, shrunk so the tests' positions cross several steps
#: of the scale (floor(p / 8)); factor * original max = max_position_embeddings, as released
MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1e6,
    "factor": 64.0,
    "original_max_position_embeddings": 8,
    "max_position_embeddings": 512,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.1,
}


def _clip() -> dict[str, Any]:
    import transformers as tf

    return tf.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        projection_dim=32,
    ).to_dict()


def model_and_config(arch: str) -> tuple[type, Any]:
    """The HF class and a tiny config of ``arch`` (text: hidden 64, 4 heads, 2 KV heads)."""
    import transformers as tf

    text: dict[str, Any] = dict(TINY_CONFIG_FIELDS)
    if arch == "llava":  # LLaVA-1.5: Llama (Vicuna) text, untied
        config = tf.LlavaConfig(
            text_config=tf.LlamaConfig(**text, tie_word_embeddings=False).to_dict(),
            vision_config=_clip(),
            image_token_index=49000,
            tie_word_embeddings=False,
        )
        return tf.LlavaForConditionalGeneration, config
    if arch == "llava_dinov2":  # a tower chassis does not run (DINOv2): served as text only
        config = tf.LlavaConfig(
            text_config=tf.LlamaConfig(**text, tie_word_embeddings=False).to_dict(),
            vision_config=tf.Dinov2Config(
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ).to_dict(),
            image_token_index=49000,
            tie_word_embeddings=False,
        )
        return tf.LlavaForConditionalGeneration, config
    if arch == "llava_next":  # Mistral text, head_dim 32 != hidden / heads
        text_config = tf.MistralConfig(**text, head_dim=32, sliding_window=None)
        config = tf.LlavaNextConfig(
            text_config=text_config.to_dict(),
            vision_config=_clip(),
            image_token_index=49000,
            image_grid_pinpoints=[[28, 28]],
        )
        return tf.LlavaNextForConditionalGeneration, config
    if arch == "internvl":  # InternVL3.5: Qwen3 text; the wrapper's tie (default true) ties
        config = tf.InternVLConfig(
            text_config=tf.Qwen3Config(**text, head_dim=32, tie_word_embeddings=False).to_dict(),
            vision_config={
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": [28, 28],
                "patch_size": [14, 14],
            },
            image_token_id=49000,
        )
        return tf.InternVLForConditionalGeneration, config
    if arch == "aya_vision":  # Cohere2 text: a sliding and a full layer, logit scale
        text_config = tf.Cohere2Config(
            **text,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=6,
            logit_scale=0.25,
        )
        config = tf.AyaVisionConfig(
            text_config=text_config.to_dict(),
            vision_config=tf.SiglipVisionConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ).to_dict(),
            image_token_index=49000,
        )
        return tf.AyaVisionForConditionalGeneration, config
    if arch == "glm4v":
        config = tf.Glm4vConfig(
            text_config={**text, "rope_parameters": dict(_GLM_ROPE)},
            vision_config=_GLM_VISION,
            tie_word_embeddings=False,
        )
        return tf.Glm4vForConditionalGeneration, config
    if arch == "glm4v_moe":
        moe = {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
        }
        config = tf.Glm4vMoeConfig(
            text_config={**text, **moe, "rope_parameters": dict(_GLM_ROPE)},
            vision_config=_GLM_VISION,
            tie_word_embeddings=False,
        )
        return tf.Glm4vMoeForConditionalGeneration, config
    ministral = tf.Ministral3Config(
        **text, head_dim=32, rope_parameters=dict(MINISTRAL3_ROPE), tie_word_embeddings=False
    )
    if arch == "ministral3":
        return tf.Ministral3ForCausalLM, ministral
    if arch == "mistral3_ministral3":
        config = tf.Mistral3Config(
            text_config=ministral.to_dict(),
            vision_config=tf.PixtralVisionConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                head_dim=16,
                image_size=28,
                patch_size=14,
            ).to_dict(),
            tie_word_embeddings=False,
        )
        return tf.Mistral3ForConditionalGeneration, config
    raise ValueError(f"unknown architecture {arch!r}")


def save_model(arch: str, directory: Path, seed: int = 5) -> Path:
    """A random float32 HF model of ``arch`` with the SmolLM2 tokenizer; every 1-D parameter
    (and the routers' ``e_score_correction_bias`` buffers) randomized."""
    cls, config = model_and_config(arch)
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir() / name, directory / name)
    return directory


def load_hf(arch: str, model_dir: Path) -> Any:
    """transformers' model of ``arch`` on ``model_dir`` (Aya Vision's logits scaled as from
    transformers 5.25 under any version: tests/fixtures_aya_vision.py)."""
    cls, _ = model_and_config(arch)
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    return scale_logits(model) if arch == "aya_vision" else model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: save_model(arch, tmp_path_factory.mktemp(f"tiny_{arch}")) for arch in ARCHITECTURES
    }


# -- logits and greedy tokens -----------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    check_parity_with(Runner(model_dirs[arch]), load_hf(arch, model_dirs[arch]), TOKEN_PROMPTS)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    """``LLM`` on the checkpoint gives HF ``generate``'s tokens for text prompts (HF's own
    text-only position handling across prefill and decode)."""
    model_dir = model_dirs[arch]
    expected = hf_greedy_tokens(
        load_hf(arch, model_dir), load_tokenizer(model_dir), PROMPTS, MAX_TOKENS
    )
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS) == expected


# -- what is built ----------------------------------------------------------------------------


def test_llava_style_checkpoints_get_their_text_decoder(model_dirs: dict[str, Path]) -> None:
    """The class registered for the LLaVA-style architectures builds the decoder registered
    for the text config's architecture (one composed class per decoder), ties the LM head as
    HF does, and refuses a text architecture chassis has no decoder for."""
    from chassis.builtin_plugins.models.cohere2 import Cohere2ForCausalLM
    from chassis.builtin_plugins.models.llama import LlamaForCausalLM
    from chassis.builtin_plugins.models.qwen3 import Qwen3ForCausalLM

    decoders = {
        "llava": LlamaForCausalLM,
        "llava_next": LlamaForCausalLM,
        "internvl": Qwen3ForCausalLM,
        "aya_vision": Cohere2ForCausalLM,
    }
    for arch, decoder in decoders.items():
        config = load_hf_config(model_dirs[arch])
        cls = model_class(config)
        assert issubclass(cls, LlavaForConditionalGeneration) and issubclass(cls, decoder)
        model = Runner(model_dirs[arch]).model
        assert type(model) is cls
        hf = load_hf(arch, model_dirs[arch])
        hf_tied = hf.lm_head.weight is hf.get_input_embeddings().weight
        assert model.tie_word_embeddings is hf_tied, arch
    # LLaVA-1.5, LLaVA-NeXT, InternVL and Aya Vision take images (tests/test_llava_images.py,
    # tests/test_llava_next_images.py, tests/test_internvl_images.py,
    # tests/test_aya_vision_images.py)
    for arch in ("llava", "llava_next", "internvl", "aya_vision"):
        llava = model_class(load_hf_config(model_dirs[arch]))
        assert issubclass(llava, LlavaForConditionalGenerationWithImages)
        assert llava.supported_modalities == {"image"}
    assert Runner(model_dirs["internvl"]).model.tie_word_embeddings  # top-level default true
    assert Runner(model_dirs["llava_next"]).model.spec.head_dim == 32
    # Aya Vision's logits are multiplied by Cohere2's logit_scale (0.25 here), as vLLM and
    # transformers from 5.25 do (tests/fixtures_aya_vision.py: scale_logits)
    aya = Runner(model_dirs["aya_vision"])
    assert aya.hf_config.logit_scale == 0.25 and aya.model.logit_scale == 0.25

    import transformers as tf

    config = load_hf_config(model_dirs["llava"])
    config.model_type = "bloom"  # a causal LM chassis has no decoder for
    with pytest.raises(ValueError, match="'bloom' text_config is not supported"):
        model_class(config)
    gemma = tf.LlavaConfig(
        text_config=tf.Gemma3TextConfig().to_dict(),
        vision_config=_clip(),
        architectures=["LlavaForConditionalGeneration"],
    )
    text = model_loader.language_model_config(gemma)
    assert text.model_type == "gemma3_text"
    assert "Gemma3ForCausalLM" in model_class(text).__name__


def test_glm_configs_are_read(model_dirs: dict[str, Path]) -> None:
    glm4v = Runner(model_dirs["glm4v"]).model
    assert isinstance(glm4v, Glm4ForCausalLM) and not isinstance(glm4v, TextOnlyWeights)
    assert glm4v.supported_modalities == {"image", "video"}  # (tests/test_glm4v_*.py)
    assert glm4v.spec.head_dim == 16 and glm4v.spec.qkv_bias and not glm4v.spec.o_bias
    assert glm4v.spec.rope["interleaved"] and glm4v.spec.rope["partial_rotary_factor"] == 0.5
    moe = Runner(model_dirs["glm4v_moe"]).model
    assert not moe.spec.rope.get("interleaved")
    assert not glm4v.tie_word_embeddings and not moe.tie_word_embeddings


# -- positions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["glm4v", "glm4v_moe"])
@pytest.mark.parametrize(
    ("head_dim", "section", "partial"),
    [(128, [8, 12, 12], 0.5), (64, [8, 12, 12], 1.0)],  # GLM-4.1V / GLM-4.5V; a whole head
)
def test_glm_mrope_of_text_positions_is_chassis_rope(
    arch: str, head_dim: int, section: list[int], partial: float
) -> None:
    """HF's M-RoPE rotation (its rotary module's tables, its ``apply_rotary_pos_emb``) of
    text positions (three equal components) is what chassis' RoPE of the decoder spec does to
    q and k: interleaved partial RoPE for GLM-4.1V, rotate-half partial RoPE for GLM-4.5V.
    Unequal components (image positions) rotate differently, so the check can fail."""
    import transformers as tf

    if arch == "glm4v":
        from transformers.models.glm4v import modeling_glm4v as hf_mod

        config_cls, rotary_cls = tf.Glm4vTextConfig, hf_mod.Glm4vTextRotaryEmbedding
    else:
        from transformers.models.glm4v_moe import modeling_glm4v_moe as hf_mod

        config_cls, rotary_cls = tf.Glm4vMoeTextConfig, hf_mod.Glm4vMoeTextRotaryEmbedding
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": section,
        "partial_rotary_factor": partial,
    }
    config = config_cls(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters=rope,
    )
    config.architectures = [
        "Glm4vForConditionalGeneration" if arch == "glm4v" else "Glm4vMoeForConditionalGeneration"
    ]
    ours_cls = model_class(config)
    spec = ours_cls.decoder_spec(config)
    ours = RotaryEmbedding(spec.head_dim, 4096, spec.rope)
    hf_rope = rotary_cls(config)
    positions = torch.tensor([0, 1, 2, 7, 100, 1000, 4095])
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 4, head_dim, generator=generator)
    k = torch.randn(len(positions), 2, head_dim, generator=generator)
    our_q, our_k = ours(positions, q.clone(), k.clone(), None)

    def hf_rotate(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = hf_rope(q, pos)
        hq, hk = hf_mod.apply_rotary_pos_emb(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
        )
        return hq[0].transpose(0, 1), hk[0].transpose(0, 1)

    hf_q, hf_k = hf_rotate(positions.view(1, 1, -1).expand(3, 1, -1))
    torch.testing.assert_close(our_q, hf_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(our_k, hf_k, atol=1e-5, rtol=1e-5)
    image = torch.stack([positions, positions // 2, positions % 5]).view(3, 1, -1)
    assert not torch.allclose(hf_rotate(image)[0], our_q, atol=1e-3)
    assert rope_parameters(config)["rope_theta"] == 10000.0


def test_ministral3_scales_queries_by_position(model_dirs: dict[str, Path]) -> None:
    """Every Ministral 3 layer scales its queries (beta and the original length from
    ``rope_parameters``) by 1 below the original length, then by steps; without the scaling
    the logits past the original length would differ from HF's."""
    for arch in ("ministral3", "mistral3_ministral3"):
        model = Runner(model_dirs[arch]).model
        attentions = [layer.self_attn for layer in model.model.layers]
        assert all(isinstance(a, Llama4ScaledAttention) for a in attentions)
        assert (attentions[0].beta, attentions[0].original_max) == (0.1, 8)
    scale = attentions[0].query_scale(torch.tensor([0, 7, 8, 15, 16, 100]))
    expected = 1 + 0.1 * torch.log(torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 13.0]))
    torch.testing.assert_close(scale, expected)

    runner = Runner(model_dirs["ministral3"])
    hf = load_hf("ministral3", model_dirs["ministral3"])
    prompt = TOKEN_PROMPTS[0]
    assert len(prompt) > 8
    with_scaling = runner.model
    for attention in [layer.self_attn for layer in with_scaling.model.layers]:
        attention.beta = 0.0
    tables = allocate_block_tables([len(prompt)], 4, 64, runner.generator)
    unscaled = runner.step([prompt], [len(prompt)], tables)
    expected = hf_logits(hf, prompt)
    torch.testing.assert_close(unscaled[:8], expected[:8], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(unscaled[8:], expected[8:], atol=1e-3)


# -- what is read -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(VISION_PREFIXES))
def test_vision_tensors_are_never_read(
    model_dirs: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader reads every language-model tensor and no vision-tower, projector or
    ``image_newline`` tensor; the model has no vision parameters."""
    model_dir = model_dirs[arch]
    in_file = set(load_file(model_dir / "model.safetensors"))
    vision = {name for name in in_file if name.startswith(VISION_PREFIXES[arch])}
    assert vision
    read: list[str] = []
    original = model_loader.iterate_checkpoint

    def spy(*args: Any, **kwargs: Any) -> Any:
        for name, tensor in original(*args, **kwargs):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(model_loader, "iterate_checkpoint", spy)
    model = Runner(model_dir).model
    assert set(read) == in_file - vision
    assert not any(
        "visual" in n or "vision" in n or "projector" in n or "newline" in n
        for n, _ in model.named_parameters()
    )


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_match_transformers(model_dirs: dict[str, Path]) -> None:
    """Two real ranks on GLM-4.1V's language model (half the heads, KV heads and each half of
    the fused gate/up columns each; vocabulary rows of the embedding and LM head): HF's
    greedy tokens."""
    model_dir = model_dirs["glm4v"]
    expected = hf_greedy_tokens(
        load_hf("glm4v", model_dir), load_tokenizer(model_dir), PROMPTS, MAX_TOKENS
    )
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()
    wait_for_no_workers()
