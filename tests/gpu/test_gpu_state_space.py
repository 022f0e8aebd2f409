"""State-space models on a GPU (run by tests/gpu/run_gpu_checks.sh's pytest step).

The engine on the CPU suite's tiny random checkpoints, float32 on CUDA: greedy tokens equal
HF ``generate``'s on the same GPU (transformers' torch paths when the ``mamba_ssm``/``fla``
kernels are absent). A dense Granite 4.0-H without position encoding (Mamba2 layers beside
``triton_paged`` attention layers) and a pure Mamba2 with whole prefills, with 7-token prefill
chunks carrying the state across steps, and with two state slots for more requests than
that; Mamba-1, Falcon-H1 and LFM2 with the chunks. The MoE models (Granite 4.0-H MoE, Jamba,
Qwen3-Next) are left to the CPU suite, out of this step's kernel compiles.
Decode graphs are not captured for these models (``graph_capture_blocker``): the engine
starts eager. tests/test_mamba2_models.py, test_mamba1_models.py, test_falcon_h1.py and
test_lfm2.py run the same checks on the CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

PROMPT_LENS = (5, 17, 40, 3, 29)

ENGINES = {"whole": {}, "chunked": {"max_num_batched_tokens": 7}, "two-slots": {"max_num_seqs": 2}}
#: (test module with ``tiny_config(arch)``, arch, engine): every engine setting on the dense
#: Granite 4.0-H and Mamba2, chunked prefill (the state carried across steps) on the others
CASES = [
    *[
        ("test_mamba2_models", arch, e)
        for arch in ("granite_dense_nope", "mamba2")
        for e in ENGINES
    ],
    ("test_mamba1_models", "mamba", "chunked"),
    ("test_falcon_h1", "released", "chunked"),
    ("test_lfm2", "released", "chunked"),
]


@pytest.mark.parametrize(("module", "arch", "engine"), CASES, ids=lambda v: str(v))
def test_engine_matches_hf_greedy_on_cuda(
    tmp_path: Path, module: str, arch: str, engine: str
) -> None:
    import importlib
    import random

    from fixtures_models import save_tiny_checkpoint
    from test_gpu_engine import NEW_TOKENS, hf_greedy

    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams

    tiny_config = importlib.import_module(module).tiny_config
    model_dir = save_tiny_checkpoint(tiny_config(arch), tmp_path / arch, seed=5)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in PROMPT_LENS]
    expected = hf_greedy(model_dir, prompts, "cuda")
    llm = LLM(
        str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        attention_backend="triton_paged",
        max_model_len=256,
        gpu_memory_utilization=0.2,
        **ENGINES[engine],
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        runner = llm.engine.executor.worker.runner
        assert runner.request_states is not None and runner.graphs is None
    finally:
        llm.shutdown()
