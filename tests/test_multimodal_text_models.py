"""Multimodal checkpoints on text prompts (Mistral 3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Qwen3-VL-MoE) against HF transformers' multimodal models on tiny random checkpoints. They take
images too (tests/test_mistral3_images.py, tests/test_qwen2_vl_images.py,
tests/test_qwen3_vl_images.py); their text prompts are checked here.

Each checkpoint is the HF multimodal class built from a config with a 2-layer, hidden-64 text
model and a 1- or 2-layer vision tower, random float32 weights (biases and norm weights
randomized too), saved with ``save_pretrained`` (transformers 5 writes the hub layout). HF
runs text-only ``input_ids`` with its own position handling (M-RoPE's three components
equal); float32 logits must match (batched prefill, a decode, a chunk over a cached prefix),
greedy tokens through ``LLM`` must be HF ``generate``'s. The M-RoPE tables are checked
against plain RoPE at real-model sizes, the vision tensors of the text-only models are never
read, both weight layouts load, and an image part in a chat message to a text-only model is
refused.
"""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS, allocate_block_tables, hf_greedy_tokens
from safetensors.torch import load_file, save_file
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy
from test_models_parity import BLOCK_SIZE, NUM_BLOCKS, Runner, hf_logits
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_tensor_parallel import wait_for_no_workers

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.mistral3 import Mistral3ForConditionalGeneration
from chassis.builtin_plugins.models.text_only import TextOnlyWeights
from chassis.core import model_loader
from chassis.core.gguf_checkpoint import embedded_model_dir
from chassis.core.layers.rotary import RotaryEmbedding, rope_parameters
from chassis.core.model_interface import ModelBuildContext
from chassis.core.model_loader import load_hf_config
from chassis.core.tokenizer import load_tokenizer

ARCHITECTURES = ("mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
#: the architectures whose vision tower is loaded and run (images accepted)
WITH_IMAGES = ("mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
#: the image side's checkpoint-name prefixes, per architecture (hub layout)
VISION_PREFIXES = {
    "mistral3": ("vision_tower.", "multi_modal_projector."),
    "qwen2_vl": ("visual.",),
    "qwen2_5_vl": ("visual.",),
    "qwen3_vl": ("model.visual.",),
    "qwen3_vl_moe": ("model.visual.",),
}
_QWEN3_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "out_hidden_size": 64,
    "num_heads": 2,
    "deepstack_visual_indexes": [0],
    "num_position_embeddings": 16,
}


def multimodal_model(arch: str) -> tuple[type, Any]:
    """The HF class and a tiny config of ``arch`` (text: hidden 64, 4 heads, 2 KV heads)."""
    import transformers as tf

    text: dict[str, Any] = dict(TINY_CONFIG_FIELDS)
    if arch == "mistral3":
        text_config = tf.MistralConfig(
            **text, head_dim=32, sliding_window=None, tie_word_embeddings=False
        )
        vision = tf.PixtralVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=16,
            image_size=28,
            patch_size=14,
        )
        config = tf.Mistral3Config(
            text_config=text_config.to_dict(),
            vision_config=vision.to_dict(),
            tie_word_embeddings=False,
        )
        return tf.Mistral3ForConditionalGeneration, config
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        # head_dim 16 = hidden / heads; mrope_section covers its 8 frequencies
        text.update(
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
        )
        if arch == "qwen2_vl":
            vision = {
                "depth": 1,
                "embed_dim": 32,
                "hidden_size": 64,
                "num_heads": 2,
                "mlp_ratio": 2,
            }
            # tied, as Qwen2-VL-2B (the flag lives on the top-level config only)
            config = tf.Qwen2VLConfig(
                text_config=text, vision_config=vision, tie_word_embeddings=True
            )
            return tf.Qwen2VLForConditionalGeneration, config
        vision = {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "fullatt_block_indexes": [0],
        }
        config = tf.Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=False
        )
        return tf.Qwen2_5_VLForConditionalGeneration, config
    text.update(
        head_dim=32,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5e5,
            "mrope_section": [6, 5, 5],
            "mrope_interleaved": True,
        },
    )
    if arch == "qwen3_vl":
        config = tf.Qwen3VLConfig(
            text_config={**text, "attention_bias": True},
            vision_config=_QWEN3_VISION,
            tie_word_embeddings=False,
        )
        return tf.Qwen3VLForConditionalGeneration, config
    if arch == "qwen3_vl_moe":
        # 2 * moe_intermediate (96) != hidden (64): the two expert layouts differ in shape.
        # The text config's class defaults tie_word_embeddings to true; HF (and the
        # released config.json) go by the top-level flag, false here.
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
        config = tf.Qwen3VLMoeConfig(
            text_config=text, vision_config=_QWEN3_VISION, tie_word_embeddings=False
        )
        assert config.text_config.tie_word_embeddings is True
        return tf.Qwen3VLMoeForConditionalGeneration, config
    raise ValueError(f"unknown architecture {arch!r}")


def save_multimodal(arch: str, directory: Path, seed: int = 3) -> Path:
    """Save a random float32 HF multimodal model of ``arch`` with the SmolLM2 tokenizer.

    Every 1-D parameter is randomized (``1 + 0.1 * randn`` for norms, ``0.1 * randn``
    otherwise), so that a bias or norm weight loaded into the wrong place changes the
    logits."""
    model_class, config = multimodal_model(arch)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir() / name, directory / name)
    return directory


def load_hf_multimodal(arch: str, model_dir: Path) -> Any:
    model_class, _ = multimodal_model(arch)
    return model_class.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: save_multimodal(arch, tmp_path_factory.mktemp(f"tiny_{arch}"))
        for arch in ARCHITECTURES
    }


def check_parity_with(runner: Runner, hf_model: Any, prompts: list[list[int]]) -> None:
    """Batched prefill, a decode and a 2-token chunk over the cached prefix: every row's
    float32 logits equal HF's multimodal model's on the text alone."""
    seq_lens = [len(p) for p in prompts]
    tables = allocate_block_tables(
        [n + 8 for n in seq_lens], BLOCK_SIZE, NUM_BLOCKS, runner.generator
    )
    logits = runner.step(prompts, seq_lens, tables)
    start, next_tokens = 0, []
    for prompt in prompts:
        expected = hf_logits(hf_model, prompt)
        torch.testing.assert_close(
            logits[start : start + len(prompt)], expected, atol=1e-4, rtol=1e-4
        )
        next_tokens.append(int(expected[-1].argmax()))
        start += len(prompt)
    extended = [[*p, t] for p, t in zip(prompts, next_tokens, strict=True)]
    logits = runner.step([[t] for t in next_tokens], [n + 1 for n in seq_lens], tables)
    for i, tokens in enumerate(extended):
        torch.testing.assert_close(logits[i], hf_logits(hf_model, tokens)[-1], atol=1e-4, rtol=1e-4)
    more = [[5, 77] for _ in prompts]
    logits = runner.step(more, [n + 3 for n in seq_lens], tables)
    for i, tokens in enumerate(extended):
        expected = hf_logits(hf_model, tokens + more[i])[-2:]
        torch.testing.assert_close(logits[2 * i : 2 * i + 2], expected, atol=1e-4, rtol=1e-4)


# -- logits and greedy tokens -----------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    runner = Runner(model_dirs[arch])
    check_parity_with(runner, load_hf_multimodal(arch, model_dirs[arch]), TOKEN_PROMPTS)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    """``LLM`` on the multimodal checkpoint gives HF ``generate``'s tokens for text prompts
    (HF's own text-only position handling across prefill and decode)."""
    model_dir = model_dirs[arch]
    expected = hf_greedy_tokens(
        load_hf_multimodal(arch, model_dir), load_tokenizer(model_dir), PROMPTS, MAX_TOKENS
    )
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS) == expected


def test_the_configs_are_read(model_dirs: dict[str, Path]) -> None:
    """The text config is what the engine builds from; the LM head is tied as HF ties it;
    the text-only classes load no image side."""
    expected_tied = {
        "mistral3": False,
        "qwen2_vl": True,  # top-level flag only
        "qwen2_5_vl": False,
        "qwen3_vl": False,
        "qwen3_vl_moe": False,  # top-level false beats the text class's default true
    }
    for arch, model_dir in model_dirs.items():
        config = load_hf_config(model_dir)
        assert config.num_hidden_layers == 2 and config.hidden_size == 64
        model = Runner(model_dir).model
        if arch == "mistral3":  # the text-only class's weights, with the image side on top
            assert model.supported_modalities == {"image"}
        else:
            assert isinstance(model, TextOnlyWeights) is (arch not in WITH_IMAGES), arch
        assert model.tie_word_embeddings is expected_tied[arch], arch
        hf = load_hf_multimodal(arch, model_dir)
        hf_tied = hf.lm_head.weight is hf.get_input_embeddings().weight
        assert hf_tied is expected_tied[arch], arch
    qwen3 = Runner(model_dirs["qwen3_vl"]).model
    assert qwen3.spec.head_dim == 32 and qwen3.spec.qkv_bias and qwen3.spec.o_bias
    assert Runner(model_dirs["qwen2_5_vl"]).model.spec.head_dim == 16
    assert Runner(model_dirs["mistral3"]).model.spec.head_dim == 32


def test_an_unsupported_mistral3_text_config_is_refused() -> None:
    """A text model other than Mistral's, Llama's or Ministral 3's (served by
    tests/test_more_multimodal_text_models.py) is refused by name rather than served wrong."""
    from transformers import Qwen2Config

    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    with pytest.raises(ValueError, match="'qwen2' text_config is not supported"):
        Mistral3ForConditionalGeneration(Qwen2Config(**TINY_CONFIG_FIELDS), ctx)


# -- M-RoPE with equal components is plain RoPE ---------------------------------------------


@pytest.mark.parametrize(
    ("arch", "head_dim", "section", "interleaved"),
    [
        ("qwen2_5_vl", 128, [16, 24, 24], False),  # Qwen2-VL / Qwen2.5-VL 7B
        ("qwen3_vl", 128, [24, 20, 20], True),  # Qwen3-VL
        ("qwen3_vl", 64, [8, 12, 12], True),  # sections that do not fill 3 * section[0]
    ],
)
def test_mrope_of_text_positions_is_plain_rope(
    arch: str, head_dim: int, section: list[int], interleaved: bool
) -> None:
    """HF's M-RoPE tables for text positions (three equal components) are the 1D RoPE
    tables chassis' decoder uses, with the text config's theta; with unequal components
    (image positions) they are not, so the comparison can fail."""
    import transformers as tf
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": section}
    fields = {
        "hidden_size": head_dim * 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
    }
    if interleaved:
        rope["mrope_interleaved"] = True
        config = tf.Qwen3VLTextConfig(**fields, head_dim=head_dim, rope_parameters=rope)
        hf_rope = Qwen3VLTextRotaryEmbedding(config)
    else:
        config = tf.Qwen2_5_VLTextConfig(**fields, rope_parameters=rope)
        hf_rope = Qwen2_5_VLRotaryEmbedding(config)
    params = rope_parameters(config)
    assert not params.get("interleaved")  # rotate-half layout; mrope_interleaved is not that
    ours = RotaryEmbedding(head_dim, 4096, params)
    positions = torch.tensor([0, 1, 2, 7, 100, 1000, 4095])
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = hf_rope(x, positions.view(1, 1, -1).expand(3, 1, -1))
    half = head_dim // 2
    for hf_table, our_table in ((cos, ours.cos_cache), (sin, ours.sin_cache)):
        hf_table = hf_table[0]  # [positions, head_dim]: both halves the same frequencies
        torch.testing.assert_close(hf_table[:, :half], our_table[positions], atol=0, rtol=0)
        torch.testing.assert_close(hf_table[:, half:], our_table[positions], atol=0, rtol=0)
    image = torch.stack([positions, positions // 2, positions % 5]).view(3, 1, -1)
    image_cos, _ = hf_rope(x, image)
    assert not torch.equal(image_cos[0][:, :half], ours.cos_cache[positions])


# -- what is read -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", [arch for arch in ARCHITECTURES if arch not in WITH_IMAGES])
def test_vision_tensors_are_never_read(
    model_dirs: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The loader reads every language-model tensor and no vision-tower or projector tensor
    (the model says no to them before they leave the file); the model has no vision
    parameters. (The Qwen VL models read their tower: tests/test_qwen2_vl_images.py,
    tests/test_qwen3_vl_images.py; Gemma 3 too: tests/test_gemma3_images.py.)"""
    model_dir = model_dirs[arch] if arch in model_dirs else save_multimodal(arch, tmp_path)
    in_file = set(load_file(model_dir / "model.safetensors"))
    vision = {name for name in in_file if name.startswith(VISION_PREFIXES[arch])}
    assert vision  # the checkpoint has a vision tower
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
        "visual" in n or "vision" in n or "projector" in n for n, _ in model.named_parameters()
    )


def _rewrite(model_dir: Path, target: Path, rename: Any) -> Path:
    """A copy of ``model_dir`` whose tensors ``rename(name, tensor) -> (name, tensor)``
    rewrote."""
    shutil.copytree(model_dir, target)
    tensors = load_file(model_dir / "model.safetensors")
    save_file(
        dict(rename(n, t) for n, t in tensors.items()),
        target / "model.safetensors",
        {"format": "pt"},
    )
    return target


@pytest.mark.parametrize("arch", ["mistral3", "qwen2_5_vl"])
def test_the_in_memory_layout_loads_too(
    model_dirs: dict[str, Path], arch: str, tmp_path: Path
) -> None:
    """transformers 5's in-memory names (``model.language_model.*``, ``lm_head.*``,
    ``model.vision_tower.*`` / ``model.visual.*``), which HF reads as well: the same
    logits as HF's on that checkpoint."""

    def in_memory(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        for old, new in (
            ("language_model.model.", "model.language_model."),
            ("language_model.lm_head.", "lm_head."),
            ("vision_tower.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
            ("visual.", "model.visual."),
            ("model.", "model.language_model."),
        ):
            if name.startswith(old):
                return new + name[len(old) :], tensor
        return name, tensor

    model_dir = _rewrite(model_dirs[arch], tmp_path / arch, in_memory)
    names = set(load_file(model_dir / "model.safetensors"))
    assert "model.language_model.embed_tokens.weight" in names and "lm_head.weight" in names
    hf = load_hf_multimodal(arch, model_dir)
    reference = load_hf_multimodal(arch, model_dirs[arch])
    prompt = TOKEN_PROMPTS[0]
    torch.testing.assert_close(hf_logits(hf, prompt), hf_logits(reference, prompt), atol=0, rtol=0)
    check_parity_with(Runner(model_dir), hf, TOKEN_PROMPTS)


def test_qwen3_vl_moe_hub_expert_layout_loads(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Hub Qwen3-VL-MoE files store ``gate_up_proj`` as ``[experts, hidden, 2 * inter]`` and
    ``down_proj`` as ``[experts, inter, hidden]`` (transformers 5 writes them the other way
    round): both load, to HF's logits."""

    def hub(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return name, tensor.transpose(1, 2).contiguous()
        return name, tensor

    model_dir = _rewrite(model_dirs["qwen3_vl_moe"], tmp_path / "hub", hub)
    tensors = load_file(model_dir / "model.safetensors")
    assert tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 96)
    assert tensors["model.language_model.layers.0.mlp.experts.down_proj"].shape == (4, 48, 64)
    check_parity_with(
        Runner(model_dir), load_hf_multimodal("qwen3_vl_moe", model_dir), TOKEN_PROMPTS
    )


# -- requests ---------------------------------------------------------------------------------


def test_an_image_part_is_refused(tmp_path: Path) -> None:
    """Text only: over the API server on a multimodal checkpoint served as text only
    (LLaVA with a DINOv2 tower, which chassis does not run), a chat message with an image part is a 400 naming the part; text still gets
    an answer (``LLM.chat`` refuses the same message)."""
    from fastapi.testclient import TestClient
    from test_more_multimodal_text_models import save_model

    from chassis.core.async_llm import AsyncLLM
    from chassis.core.config import EngineConfig
    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    model_dir = save_model("llava_dinov2", tmp_path)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with_image = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]
    engine = AsyncLLM.from_engine_config(
        EngineConfig(model=str(model_dir), dtype="float32", max_model_len=128, num_kv_blocks=32)
    )
    try:
        with TestClient(build_app(engine, ServerSettings(shutdown_engine_on_exit=False))) as client:
            refused = client.post("/v1/chat/completions", json={"messages": with_image})
            assert refused.status_code == 400
            assert "only text parts" in refused.json()["error"]["message"]
            text = [{"role": "user", "content": "Hi"}]
            answered = client.post("/v1/chat/completions", json={"messages": text, "max_tokens": 2})
            assert answered.status_code == 200
            assert answered.json()["choices"][0]["message"]["content"] is not None
    finally:
        engine.shutdown_sync()
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, num_kv_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with pytest.raises(ValueError, match="only text parts"):
        llm.chat(with_image, params)


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl_moe"])
def test_two_ranks_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    """Two real ranks on the language model (half the heads, KV heads and MLP or every
    expert's intermediate columns each; Qwen2-VL's tied head split by vocabulary rows): HF's
    greedy tokens."""
    model_dir = model_dirs[arch]
    expected = hf_greedy_tokens(
        load_hf_multimodal(arch, model_dir), load_tokenizer(model_dir), PROMPTS, MAX_TOKENS
    )
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
