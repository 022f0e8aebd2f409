"""The helpers the image models share (processor_files, image_item_inputs,
image_side_weights.renamed_by_prefix): their results and the exact refusals the models' own
tests reach through them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from chassis.builtin_plugins.models.image_item_inputs import image_run_inputs, image_tiles
from chassis.builtin_plugins.models.image_side_weights import renamed_by_prefix
from chassis.builtin_plugins.models.processor_files import (
    image_processor_source,
    image_token_ids,
    saved_processor_config,
)


class _Tokenizer:
    """The three calls image_token_ids makes of a transformers tokenizer."""

    unk_token_id = 0
    vocab = {"<unk>": 0, "<image>": 5, "<fake>": 6}

    def convert_tokens_to_ids(self, name: str) -> int:
        return self.vocab.get(name, self.unk_token_id)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return {v: k for k, v in self.vocab.items()}[token_id]


def test_image_processor_source(tmp_path):
    config = SimpleNamespace(image_token_id=5)
    with pytest.raises(ValueError, match=r"has no preprocessor_config.json: its image"):
        image_processor_source(tmp_path, config)
    (tmp_path / "preprocessor_config.json").write_text("{}")
    with pytest.raises(ValueError, match="the model's config lacks image_token_id"):
        image_processor_source(str(tmp_path), SimpleNamespace())
    assert image_processor_source(tmp_path, config) == (tmp_path / "preprocessor_config.json", 5)


def test_saved_processor_config(tmp_path):
    assert saved_processor_config(tmp_path) == {}
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_len": 4}))
    assert saved_processor_config(tmp_path) == {"image_seq_len": 4}


def test_image_token_ids():
    tok = _Tokenizer()
    assert image_token_ids(tok, ["<fake>", "<image>"], "<image>", 5) == [6, 5]
    with pytest.raises(ValueError, match="tokenizer has no '<row>' token: it cannot take images"):
        image_token_ids(tok, ["<image>", "<row>"], "<image>", 5)
    with pytest.raises(
        ValueError, match="'<image>' is token 5, but the config's image_token_id is 7"
    ):
        image_token_ids(tok, ["<image>", "<fake>"], "<image>", 7)


def test_image_run_inputs_and_tiles():
    pixels, run = torch.zeros(1, 3, 4, 4), torch.tensor([1, 2])
    got = image_run_inputs(object(), "image", {"pixel_values": pixels, "placeholder_ids": run})
    assert got[0] is pixels and got[1] is run
    with pytest.raises(ValueError, match="object takes images, not 'audio' inputs"):
        image_run_inputs(object(), "audio", {})
    with pytest.raises(
        ValueError, match=r"need pixel_values and placeholder_ids \(got \['pixel_values'\]\)"
    ):
        image_run_inputs(object(), "image", {"pixel_values": pixels})
    assert image_tiles(torch.zeros(1, 2, 3, 4, 4)).shape == (2, 3, 4, 4)
    assert image_tiles(pixels) is pixels
    with pytest.raises(ValueError, match=r"a feature holds one image.*got \(3, 4, 4\)"):
        image_tiles(torch.zeros(3, 4, 4))


def test_renamed_by_prefix():
    table = (("model.vision_tower.", "vision_tower."), ("vision_tower.", "vision_tower."))
    assert renamed_by_prefix("model.vision_tower.a.weight", table) == "vision_tower.a.weight"
    assert renamed_by_prefix("vision_tower.b", table) == "vision_tower.b"
    assert renamed_by_prefix("model.layers.0.weight", table) is None
