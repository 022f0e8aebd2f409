"""State-space models on a GPU (run by tests/gpu/run_gpu_checks.sh's pytest step).

The engine on tests/test_mamba2_models.py's tiny random checkpoints (a dense Granite 4.0-H
without position encoding: Mamba2 layers beside ``triton_paged`` attention layers; a pure
Mamba2; the MoE variant is left to the CPU suite, out of this step's kernel compiles), float32 on
CUDA: greedy tokens equal HF ``generate``'s on the same GPU (transformers' torch path when
the ``mamba_ssm`` kernels are absent), with whole prefills, with 7-token prefill chunks
carrying the state across steps, and with two state slots for more requests than that.
Decode graphs are not captured for these models (``graph_capture_blocker``): the engine
starts eager. tests/test_mamba2_models.py runs the same checks on the CPU.
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


@pytest.mark.parametrize("arch", ["granite_dense_nope", "mamba2"])
@pytest.mark.parametrize(
    "engine",
    [{}, {"max_num_batched_tokens": 7}, {"max_num_seqs": 2}],
    ids=["whole", "chunked", "two-slots"],
)
def test_engine_matches_hf_greedy_on_cuda(tmp_path: Path, arch: str, engine: dict) -> None:
    import random

    from fixtures_models import save_tiny_checkpoint
    from test_gpu_engine import NEW_TOKENS, hf_greedy
    from test_mamba2_models import tiny_config

    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams

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
        **engine,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        runner = llm.engine.executor.worker.runner
        assert runner.request_states is not None and runner.graphs is None
    finally:
        llm.shutdown()
