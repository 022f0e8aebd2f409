"""MTP speculative decoding on a GPU (run by tests/gpu/run_gpu_checks.sh's ``moe`` step,
marker ``gpu_moe``: both targets are mixtures of experts).

tests/test_mtp.py's tiny DeepSeek-V3 (MLA) and GLM-4.5 checkpoints with a "mirror" MTP layer
(its proposal is the target's next token), float32, ``triton_paged``, decode graphs as the
engine chooses: greedy output with ``--speculative-config '{"method": "mtp",
"num_speculative_tokens": k}'`` equals plain decoding's for k = 1 and 2, and most drafts are
accepted. tests/test_mtp.py runs the same on the CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu_moe,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]


@pytest.mark.parametrize("kind", ["v3", "glm"])
def test_mtp_drafting_keeps_greedy_output_on_cuda(tmp_path: Path, kind: str) -> None:
    from spec_decode_helpers import greedy, token_ids
    from test_deepseek_models import write_checkpoint as write_deepseek
    from test_glm4_moe_model import write_checkpoint as write_glm
    from test_mtp import add_mtp_layer, mtp_llm

    write = (lambda d: write_deepseek("v3", d)) if kind == "v3" else write_glm
    model_dir = add_mtp_layer(write(tmp_path / kind), mirror=True)
    cuda = {"attention_backend": "triton_paged", "gpu_memory_utilization": 0.2}
    plain = mtp_llm(model_dir, None, **cuda)
    try:
        expected = token_ids(plain, greedy())
    finally:
        plain.shutdown()
    for k in (1, 2):
        llm = mtp_llm(model_dir, k, **cuda)
        try:
            assert token_ids(llm, greedy()) == expected, k
            stats = llm.engine.scheduler.stats()
            drafted, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
            assert drafted > 0 and accepted > drafted / 2, (k, accepted, drafted)
        finally:
            llm.shutdown()
