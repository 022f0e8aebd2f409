"""The whole engine on a GPU: ``LLM`` greedy tokens equal HF ``generate``'s (run by
tests/gpu/run_gpu_checks.sh before the benchmarks, so a broken GPU path fails here, fast).

A tiny random Qwen3 checkpoint is written with transformers (weights, no tokenizer), so the
engine runs with ``skip_tokenizer_init`` exactly as the benchmark preset does. float32 on
both sides (the Triton attention computes float32 dots in IEEE precision), so greedy choices
agree token for token; a small token budget forces chunked prefills mixed with decodes.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

VOCAB = 512
PROMPT_LENS = (5, 17, 40, 3)
NEW_TOKENS = 8


#: the shapes of the tiny Qwen3 models: 2 layers, head_dim 32 != hidden / heads, q/k norms,
#: peaked logits (initializer_range 0.1)
TINY_QWEN3 = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_qwen3(directory) -> None:
    """A dense tiny Qwen3, tied embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**TINY_QWEN3, tie_word_embeddings=True)
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(directory)


#: HF's reference attention. On the H200 (transformers 5.17, 2026-12-04) HF's default on the
#: GPU dropped Gemma 2's attention soft cap: its logits there equal eager HF's with
#: ``attn_logit_softcapping=None`` to four decimals, and the engine, which applies the cap,
#: "diverged" at a near-tie. Eager is HF's implementation of every feature.
HF_ATTENTION = "eager"


def hf_greedy(directory, prompts: list[list[int]], device: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation=HF_ATTENTION
    ).to(device)
    model.eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def divergence_report(
    directory, prompts: list[list[int]], expected: list[list[int]], got: list[list[int]]
) -> str:
    """For a failed exact-token comparison: where the first sequence diverges, HF's two best
    logits there on the GPU and on the CPU (a gap near float32 rounding is a near-tie, not a
    broken kernel; a GPU/CPU disagreement points at HF's GPU path, as Gemma 2's dropped soft
    cap did, see :data:`HF_ATTENTION`), and the float32 matmul settings in force."""
    import os

    from transformers import AutoModelForCausalLM

    for prompt, want, have in zip(prompts, expected, got, strict=True):
        if want == have:
            continue
        i = next((j for j, (a, b) in enumerate(zip(want, have, strict=False)) if a != b), None)
        if i is None:
            return f"prompt of {len(prompt)}: lengths differ ({len(want)} vs {len(have)})"
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation=HF_ATTENTION
        )
        tops = {}
        for device in ("cuda", "cpu"):
            with torch.inference_mode():
                ids = torch.tensor([prompt + want[:i]], device=device)
                logits = model.to(device)(input_ids=ids).logits[0, -1].cpu()
            top = torch.topk(logits, 2)
            tops[device] = (
                f"HF on {device}: top-2 logits {top.values.tolist()} for ids "
                f"{top.indices.tolist()}, logit of the token got {logits[have[i]].item()}"
            )
        settings = (
            f"matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}, "
            f"float32_matmul_precision={torch.get_float32_matmul_precision()}, "
            "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE="
            f"{os.environ.get('TORCH_ALLOW_TF32_CUBLAS_OVERRIDE')}"
        )
        return (
            f"prompt of {len(prompt)} tokens diverges at new token {i}: expected {want[i]}, "
            f"got {have[i]}; {tops['cuda']}; {tops['cpu']}; {settings}"
        )
    return "no divergence"


def chassis_greedy(directory, prompts: list[list[int]], **engine: object) -> list[list[int]]:
    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams

    llm = LLM(str(directory), skip_tokenizer_init=True, dtype="float32", **engine)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert all(o.outputs[0].text == "" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


def assert_greedy_matches_hf(directory, seed: int, **engine: object) -> None:
    """Random prompts of :data:`PROMPT_LENS` tokens: the engine's greedy tokens on the GPU
    equal HF's."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    expected = hf_greedy(directory, prompts, "cuda")
    got = chassis_greedy(
        directory,
        prompts,
        max_model_len=256,
        max_num_batched_tokens=32,  # the 40-token prompt is prefilled in two chunks
        gpu_memory_utilization=0.2,  # sized by determine_kv_cache_memory, not a fixed count
        **engine,
    )
    assert got == expected, divergence_report(directory, prompts, expected, got)


@pytest.mark.parametrize(
    "engine",
    [
        {"enforce_eager": True},
        {"async_scheduling": True},
        pytest.param({"torch_compile": True}, marks=pytest.mark.gpu_compile),
    ],
    ids=["eager", "graphs-async", "graphs-compile"],
)
def test_llm_matches_hf_greedy_on_the_gpu(tmp_path, engine):
    """The eager engine, the engine with decode graphs and async scheduling (the decode
    inputs then come from the device), and decode graphs of the torch.compile'd forward,
    against HF."""
    from chassis.platforms import get_current_platform

    assert get_current_platform().device_type == "cuda"
    write_tiny_qwen3(tmp_path)
    assert_greedy_matches_hf(tmp_path, seed=0, **engine)
    gc.collect()  # the engine's KV cache goes before the next test sizes its own
    torch.cuda.empty_cache()


def write_tiny_qwen3_moe(directory) -> None:
    """The tiny Qwen3 with 8 experts of intermediate 32 (top 2) in each layer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **TINY_QWEN3,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(torch.float32).save_pretrained(directory)


@pytest.mark.gpu_moe
@pytest.mark.parametrize("engine", [{"enforce_eager": True}, {}], ids=["moe-eager", "moe-graphs"])
def test_moe_llm_matches_hf_greedy_on_the_gpu(tmp_path, engine):
    """The experts run the Triton fused-MoE kernel, which reads nothing back to the host,
    so decode steps of a MoE model are captured as graphs too."""
    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams

    write_tiny_qwen3_moe(tmp_path)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    expected = hf_greedy(tmp_path, prompts, "cuda")
    llm = LLM(
        str(tmp_path),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=32,
        gpu_memory_utilization=0.2,
        **engine,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == expected, divergence_report(tmp_path, prompts, expected, got)
    graphs = llm.engine.executor.worker.runner.graphs
    assert (graphs is not None) == (not engine), "decode graphs captured unless eager"
    if graphs is not None:
        assert graphs.num_replays > 0
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def write_tiny_gemma2(directory) -> None:
    """A tiny Gemma 2: sliding (window 8) and full layers, attention and final soft caps."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    shapes = {k: v for k, v in TINY_QWEN3.items() if k != "initializer_range"}
    config = Gemma2Config(
        **shapes,
        sliding_window=8,
        query_pre_attn_scalar=32,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    Gemma2ForCausalLM(config).to(torch.float32).save_pretrained(directory)


@pytest.mark.parametrize(
    "engine", [{"enforce_eager": True}, {}], ids=["gemma2-eager", "gemma2-graphs"]
)
def test_windowed_soft_capped_llm_matches_hf_greedy_on_the_gpu(tmp_path, engine):
    """triton_paged's SLIDING_WINDOW and SOFT_CAP variants inside the engine, eager and in
    decode graphs, on prompts longer than the window."""
    write_tiny_gemma2(tmp_path)
    assert_greedy_matches_hf(tmp_path, seed=2, **engine)
    gc.collect()
    torch.cuda.empty_cache()


def write_random_lora(directory, model_dir, targets=("q_proj", "v_proj", "down_proj")) -> None:
    """A random rank-4 PEFT adapter for the tiny model in ``model_dir``."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in targets:
            out_features, in_features = module.weight.shape
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(4, in_features, generator=generator) * 0.2
            tensors[f"{key}.lora_B.weight"] = (
                torch.randn(out_features, 4, generator=generator) * 0.2
            )
    directory.mkdir()
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": list(targets)}
    (directory / "adapter_config.json").write_text(json.dumps(config))


def test_lora_batch_matches_hf_merged_on_the_gpu(tmp_path):
    """A batch mixing an adapter and the base model, with decode graphs on (captured with
    the adapter matmuls: every decode step replays, with or without adapters): each request
    equals HF greedy on its own weights (the adapter merged in)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from chassis.core.llm import LLM
    from chassis.core.lora import LoRARequest
    from chassis.core.sampling_params import SamplingParams

    model_dir, adapter_dir = tmp_path / "model", tmp_path / "adapter"
    write_tiny_qwen3(model_dir)
    write_random_lora(adapter_dir, model_dir)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    base = hf_greedy(model_dir, prompts, "cuda")
    merged = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
        for key, a in tensors.items():
            if ".lora_A." in key:
                b = tensors[key.replace(".lora_A.", ".lora_B.")]
                name = key.removeprefix("base_model.model.").split(".lora_A.")[0]
                merged.get_submodule(name).weight += 2.0 * (b @ a)  # alpha 8 / r 4
    merged_dir = tmp_path / "merged"
    merged.save_pretrained(merged_dir)
    adapted = hf_greedy(merged_dir, prompts, "cuda")
    llm = LLM(
        str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=32,
        gpu_memory_utilization=0.2,
        enable_lora=True,
        max_lora_rank=8,
    )
    lora = LoRARequest("adapter", 1, str(adapter_dir))
    loras = [lora, None, lora, None]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    got = [o.outputs[0].token_ids for o in outputs]
    expected = [adapted[i] if loras[i] else base[i] for i in range(len(prompts))]
    assert adapted != base
    assert got == expected
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_embeddings_match_hf_on_the_gpu(tmp_path):
    """A pooling engine (last token, normalized, prompts chunked by a small token budget)
    against HF's last hidden state pooled the same way, float32 on the GPU."""
    from transformers import AutoModel

    from chassis.core.llm import LLM

    write_tiny_qwen3(tmp_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    model = AutoModel.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden = model(input_ids=torch.tensor([prompt], device="cuda")).last_hidden_state
            expected.append(torch.nn.functional.normalize(hidden[0, -1], dim=-1).cpu())
    llm = LLM(
        str(tmp_path),
        runner="pooling",
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=32,  # the 40-token prompt is computed in two chunks
        gpu_memory_utilization=0.2,
    )
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts])
    for output, want in zip(outputs, expected, strict=True):
        got = torch.tensor(output.outputs.embedding)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
