"""Loading a 4-bit checkpoint packed holds one layer's 16-bit weight at a time, never the
whole dequantized model (core/int4_streaming.py).

The layers the loader holds dequantized at once, counted as it packs them, and the peak
resident memory of a model build in a fresh process (tests/perf/int4_load_peak.py), packed
against dequantized.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_int4_checkpoints import SCHEMES, write_int_twins
from torch import nn

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.core import int4_streaming
from chassis.core.config import EngineConfig
from chassis.core.layers.int4_linear import Int4Linear
from chassis.core.model_loader import build_model, load_hf_config

sys.path.insert(0, str(Path(__file__).parent / "perf"))
import int4_load_peak


def _dequantized_linears(model: nn.Module) -> dict[str, int]:
    """The bytes of each ``nn.Linear`` weight the model holds (neither meta nor a
    one-element placeholder)."""
    return {
        name: m.weight.untyped_storage().nbytes()
        for name, m in model.named_modules()
        if type(m) is nn.Linear and m.weight.device.type != "meta"
    }


def test_the_loader_holds_one_layer_dequantized_at_a_time(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each time a layer is packed, the decoder's 16-bit weights the loader holds are at
    most one decoder layer's (the layer being packed and the ones loading beside it), and
    every layer is packed in the end, giving the weights of the dequantized build."""
    quantized, _, _ = write_int_twins(tiny_llama_dir, tmp_path, SCHEMES["gptq-4bit-g32"])
    hf_config = load_hf_config(quantized)

    def build(mode: str) -> nn.Module:
        config = EngineConfig(model=str(quantized), int4_weights=mode)
        return build_model(config, hf_config, quantized, TorchPagedAttention, "cpu", torch.bfloat16)

    dense = build("dequantized")
    layer_bytes = sum(
        m.weight.untyped_storage().nbytes()
        for m in dense.model.layers[0].modules()
        if type(m) is nn.Linear
    )
    held: list[int] = []
    pack = int4_streaming.Int4StreamPacker._pack

    def recording_pack(self: int4_streaming.Int4StreamPacker, layer: str) -> None:
        held.append(
            sum(
                size
                for name, size in _dequantized_linears(self.model).items()
                if ".layers." in name
            )
        )
        pack(self, layer)

    monkeypatch.setattr(int4_streaming.Int4StreamPacker, "_pack", recording_pack)
    packed = build("packed")
    assert len(held) == 4 * hf_config.num_hidden_layers  # qkv, o, gate_up, down per layer
    assert 0 < max(held) <= layer_bytes, (held, layer_bytes)
    # nothing of the decoder is left dequantized; the head and embeddings load as before
    assert set(_dequantized_linears(packed)) == {"lm_head"}
    for name, module in packed.named_modules():
        if isinstance(module, Int4Linear):
            expected = dense.get_submodule(name).weight
            assert torch.equal(module.dequantized_weight(torch.bfloat16), expected), name


@pytest.mark.timeout(600)
def test_packed_loading_peaks_below_the_dequantized_model(tmp_path: Path) -> None:
    """A 6-layer bfloat16 Llama (~74 MiB of 16-bit layer weights): built packed, the
    resident peak (less the checkpoint file's mapped pages, the same in both builds) rises
    by less than the dequantized model's bytes plus one layer's, and by less than three
    quarters of the dequantized build's rise, which holds more than its whole model. Before
    layers were packed as they load, the packed build peaked above the dequantized one (the
    whole dequantized model plus every packed tensor; docs/models.md)."""
    hidden, mlp = 768, 2048
    checkpoint = int4_load_peak.write_checkpoint(
        tmp_path, layers=6, hidden=hidden, mlp=mlp, vocab=1024
    )
    # q and o hidden x hidden, k and v half of it (half the heads), gate/up/down hidden x mlp
    layer_bytes = 2 * (3 * hidden * hidden + 3 * hidden * mlp)
    dense = int4_load_peak.measure(checkpoint, "dequantized")
    packed = int4_load_peak.measure(checkpoint, "packed")
    assert packed["packed_layers"] == 24 and dense["packed_layers"] == 0
    assert packed["model_bytes"] < 0.4 * dense["model_bytes"]
    assert dense["peak_less_file"] > dense["model_bytes"], dense
    assert packed["peak_less_file"] < dense["model_bytes"] + layer_bytes, (packed, dense)
    assert packed["peak_less_file"] < 0.75 * dense["peak_less_file"], (packed, dense)
