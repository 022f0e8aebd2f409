"""``--mamba-cache-dtype`` / ``--mamba-ssm-cache-dtype`` for the state-space layers beyond
Mamba2 (whose pool tests are tests/test_request_state_pool.py): Mamba-1's conv window and
SSM state and Qwen3-Next's Gated DeltaNet conv window and delta-rule state, on the tiny
random-weight checkpoints of tests/test_mamba1_models.py and tests/test_qwen3_next.py run
in bfloat16. By default both states are bfloat16 (the model's dtype, as vLLM); the flags
widen them; every setting generates, and the first token (from a prefill that starts at
zero states) is the same in all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures_models import save_tiny_checkpoint
from test_mamba1_models import save_checkpoint
from test_mamba1_models import tiny_config as mamba1_config
from test_qwen3_next import tiny_config as qwen3_next_config

from chassis import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ["The capital of France is", "Once upon a time there was", "1 2 3 4"]
BF16, F32 = torch.bfloat16, torch.float32
SMALL = {"max_model_len": 64, "num_kv_blocks": 32}
#: flags -> (conv dtype, SSM / delta-rule state dtype)
SETTINGS: dict[str, tuple[dict[str, str], tuple[torch.dtype, torch.dtype]]] = {
    "auto": ({}, (BF16, BF16)),
    "ssm-f32": ({"mamba_ssm_cache_dtype": "float32"}, (BF16, F32)),
    "all-f32": ({"mamba_cache_dtype": "float32"}, (F32, F32)),
}
#: the state-space layers of each tiny model (Qwen3-Next's middle layer is attention)
NUM_STATE_LAYERS = {"mamba": 3, "qwen3_next": 2}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "mamba": save_checkpoint(mamba1_config("mamba"), tmp_path_factory.mktemp("mamba")),
        "qwen3_next": save_tiny_checkpoint(
            qwen3_next_config(), tmp_path_factory.mktemp("qwen3_next"), seed=5
        ),
    }


@pytest.mark.parametrize("arch", ["mamba", "qwen3_next"])
def test_a_bfloat16_model_keeps_its_states_in_bfloat16_unless_told(
    model_dirs: dict[str, Path], arch: str
) -> None:
    per_slot, tokens = {}, {}
    for label, (flags, dtypes) in SETTINGS.items():
        llm = LLM(str(model_dirs[arch]), dtype="bfloat16", **SMALL, **flags)
        pool = llm.engine.executor.worker.runner.request_states
        assert pool is not None
        # conv window then SSM / delta-rule state, per state-space layer
        assert [t.dtype for t in pool.tensors] == list(dtypes) * NUM_STATE_LAYERS[arch]
        assert [s.kind for s in pool.specs] == ["conv", "ssm"] * NUM_STATE_LAYERS[arch]
        per_slot[label] = pool.bytes_per_slot
        tokens[label] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        llm.shutdown()
    assert per_slot["all-f32"] == 2 * per_slot["auto"] > per_slot["ssm-f32"] > per_slot["auto"]
    for got in tokens.values():
        assert [len(t) for t in got] == [6] * len(PROMPTS)
        assert [t[0] for t in got] == [t[0] for t in tokens["auto"]]
