"""HF's gpt-oss as the reference at the configured SwiGLU constants (test helper).

gpt-oss clamps its experts' SwiGLU at ``swiglu_limit`` (7 in the released checkpoints) and
scales the gate's sigmoid by ``swiglu_alpha`` (1.702). chassis reads both from the config
(``builtin_plugins/models/gpt_oss.py``), as transformers 5.24 (our development version)
does; transformers 5.17 (the H200 image's version) ignores the config and fixes them at
1.702 and 7.0 in ``GptOssExperts.__init__``. The tiny test models set ``swiglu_limit`` 1.5 so that the
clamps bind, so under 5.17 HF computes another model than the checkpoint describes.

:func:`make_hf_read_swiglu_config` makes an HF that fixes them read them from the config the
way newer versions do (the two attributes its ``_apply_gate`` uses); on an HF that reads
them already it changes nothing. Used by tests/test_gpt_oss.py and
tests/gpu/test_gpu_triton_moe_gpt_oss.py (no imports beyond torch and transformers: the GPU
image lacks the server's packages).
"""

from __future__ import annotations

from typing import Any

import pytest


def hf_reads_swiglu_config() -> bool:
    """Whether the installed transformers' ``GptOssExperts`` takes ``alpha`` and ``limit``
    from the config's ``swiglu_alpha`` and ``swiglu_limit``."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(
        hidden_size=8,
        intermediate_size=8,
        num_local_experts=1,
        swiglu_alpha=1.25,
        swiglu_limit=1.5,
    )
    experts = GptOssExperts(config)
    return (experts.alpha, experts.limit) == (1.25, 1.5)


def make_hf_read_swiglu_config(monkeypatch: pytest.MonkeyPatch) -> bool:
    """Patch (for the calling test, through ``monkeypatch``) an HF ``GptOssExperts`` that fixes
    ``alpha`` and ``limit`` to read them from its config, defaulting to the values it fixes;
    returns whether it patched (False: this transformers reads them itself)."""
    if hf_reads_swiglu_config():
        return False
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    original_init = GptOssExperts.__init__

    def init_with_config_constants(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, config, *args, **kwargs)
        self.alpha = float(getattr(config, "swiglu_alpha", self.alpha))
        self.limit = float(getattr(config, "swiglu_limit", self.limit))

    monkeypatch.setattr(GptOssExperts, "__init__", init_with_config_constants)
    return True
