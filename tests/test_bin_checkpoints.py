"""PyTorch ``.bin`` checkpoints (``--load-format auto|pt``, core/weights.py, core/bin_weights.py).

transformers 5 always saves safetensors (``safe_serialization=False`` is ignored), so the
``.bin`` checkpoints here are written as transformers 4 wrote them: ``torch.save`` of the state
dict as ``pytorch_model.bin``, or of its shards as ``pytorch_model-0000i-of-0000n.bin`` with
``pytorch_model.bin.index.json`` (``weight_map``). Each folder also holds a
``training_args.bin`` (a pickled object that ``weights_only`` refuses: reading it would fail).

- A tiny Llama (one file, and three shards plus a stale unlisted shard) and a tiny OPT in
  opt-125m's layout (``decoder.*`` names, no ``lm_head``): ``LLM``'s greedy tokens equal those
  of the safetensors copy and of HF transformers loading the ``.bin`` folder; a tiny BERT's
  embeddings equal its safetensors copy's.
- ``auto``/``pt``/``safetensors`` pick the files and refuse what they cannot read; a ``.bin``
  that is not a state dict of tensors is a ``ValueError`` naming the file.
- The hub download fetches safetensors, else ``pytorch_model*.bin`` (a fake snapshot_download).
- A PEFT adapter saved as ``adapter_model.bin`` applies as its safetensors twin does.
"""

from __future__ import annotations

import fnmatch
import json
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_lora import greedy_with_adapters, lora_engine, write_peft_adapter
from fixtures_models import write_tiny_checkpoint
from safetensors.torch import load_file
from test_llm_parity import PROMPTS, hf_greedy
from test_opt_gpt2 import tiny_config, write_checkpoint

from chassis import LLM, SamplingParams
from chassis.core.bin_weights import bin_weight_files, load_bin_state_dict
from chassis.core.lora import LoRARequest
from chassis.core.weights import checkpoint_tensor_names, iterate_checkpoint, weight_format

MAX_TOKENS = 8


@dataclass
class TrainingArguments:
    """Stands in for the pickled ``transformers.TrainingArguments`` of ``training_args.bin``."""

    learning_rate: float = 1e-4


def save_as_bin(
    source: Path, target: Path, shards: int = 1, rename: Any = None, keep_safetensors=False
) -> Path:
    """Copy the safetensors checkpoint ``source`` to ``target`` as a ``.bin`` checkpoint of
    ``shards`` files (module docstring), names passed through ``rename``."""
    shutil.copytree(source, target)
    tensors = load_file(source / "model.safetensors")
    if rename is not None:
        tensors = {rename(name): tensor for name, tensor in tensors.items()}
    if not keep_safetensors:
        (target / "model.safetensors").unlink()
    (target / "training_args.bin").write_bytes(pickle.dumps(TrainingArguments()))
    if shards == 1:
        torch.save(tensors, target / "pytorch_model.bin")
        return target
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {name: tensors[name] for name in names[i::shards]}
        torch.save(part, target / file)
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (target / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return target


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bin_checkpoints")
    llama = write_tiny_checkpoint("llama", root / "llama")
    opt = write_checkpoint(tiny_config("opt"), root / "opt")
    sharded = save_as_bin(llama, root / "llama_sharded", shards=3)
    # a stale shard the index does not list: not a torch file at all, so reading it fails
    (sharded / "pytorch_model-00001-of-00002.bin").write_bytes(b"stale")
    return {
        "llama": llama,
        "llama_bin": save_as_bin(llama, root / "llama_bin"),
        "llama_sharded": sharded,
        "opt": opt,
        # opt-125m's .bin: bare decoder.* names, the tied head not stored
        "opt_bin": save_as_bin(opt, root / "opt_bin", rename=lambda n: n.removeprefix("model.")),
    }


def chassis_greedy(model_dir: Path, **engine: Any) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, num_kv_blocks=64, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)]


# -- greedy parity ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "reference"),
    [("llama_bin", "llama"), ("llama_sharded", "llama"), ("opt_bin", "opt")],
)
def test_bin_checkpoint_generates_as_safetensors_and_hf(
    dirs: dict[str, Path], name: str, reference: str
) -> None:
    expected = chassis_greedy(dirs[reference])
    assert chassis_greedy(dirs[name]) == expected
    assert chassis_greedy(dirs[name], load_format="pt") == expected
    assert hf_greedy(dirs[name], PROMPTS[:3], MAX_TOKENS) == expected


def test_bert_bin_checkpoint_embeds_as_safetensors(tmp_path: Path) -> None:
    """An encoder (BERT, the pooling runner) reads a ``.bin`` checkpoint through the same
    reader: the same embeddings as its safetensors copy."""
    from bert_checkpoints import write_bert

    source = write_bert(tmp_path / "bert")
    copy = save_as_bin(source, tmp_path / "bert_bin")
    texts = ["hello world", "the cat sat on the mat"]
    got = [LLM(str(d), dtype="float32").embed(texts) for d in (source, copy)]
    assert [o.outputs.embedding for o in got[1]] == [o.outputs.embedding for o in got[0]]


# -- which files are read ---------------------------------------------------------------------


def test_bin_weight_files_follow_transformers_names(dirs: dict[str, Path]) -> None:
    assert bin_weight_files(dirs["llama_bin"]) == [dirs["llama_bin"] / "pytorch_model.bin"]
    # only the index's shards: not the stale one, never training_args.bin
    assert [f.name for f in bin_weight_files(dirs["llama_sharded"])] == [
        f"pytorch_model-0000{i}-of-00003.bin" for i in (1, 2, 3)
    ]
    assert bin_weight_files(dirs["llama"]) == []


def test_tensor_names_and_wanted_filter(dirs: dict[str, Path]) -> None:
    stored = set(load_file(dirs["llama"] / "model.safetensors"))
    for name in ("llama_bin", "llama_sharded"):
        assert checkpoint_tensor_names(dirs[name]) == {n.removeprefix("model.") for n in stored}
        read = dict(iterate_checkpoint(dirs[name], wanted=lambda n: ".layers.1." in n))
        assert read and set(read) == {n for n in stored if ".layers.1." in n}
    assert "decoder.embed_tokens.weight" in checkpoint_tensor_names(dirs["opt_bin"])


def test_load_format_picks_the_files(dirs: dict[str, Path], tmp_path: Path) -> None:
    """A folder with both kinds, their weights different: ``auto`` and ``safetensors`` read
    the safetensors file, ``pt`` the ``.bin``."""
    both = save_as_bin(dirs["llama"], tmp_path / "both", keep_safetensors=True)
    state = torch.load(both / "pytorch_model.bin", weights_only=True)
    torch.save({name: tensor + 1 for name, tensor in state.items()}, both / "pytorch_model.bin")
    name = "model.norm.weight"
    original = load_file(dirs["llama"] / "model.safetensors")[name]
    for load_format, offset in (("auto", 0), ("safetensors", 0), ("pt", 1)):
        read = dict(iterate_checkpoint(both, load_format, wanted=lambda n: n == name))
        assert torch.equal(read[name], original + offset), load_format
    assert weight_format(both) == "safetensors" and weight_format(both, "pt") == "pt"
    assert weight_format(dirs["llama_bin"]) == "pt"


def test_missing_weights_are_clear_errors(dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no PyTorch \.bin weights.*use --load-format auto"):
        LLM(str(dirs["llama"]), load_format="pt", max_model_len=64)
    with pytest.raises(ValueError, match=r"no \*\.safetensors files \(--load-format safetensors"):
        LLM(str(dirs["llama_bin"]), load_format="safetensors", max_model_len=64)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(dirs["llama"] / "config.json", empty / "config.json")
    (empty / "training_args.bin").write_bytes(pickle.dumps(TrainingArguments()))
    with pytest.raises(ValueError, match=r"no model weights: looked for \*\.safetensors and "):
        weight_format(empty)
    with pytest.raises(ValueError, match="--load-format must be one of auto, safetensors, pt"):
        LLM(str(dirs["llama"]), load_format="npcache")


def test_index_naming_a_missing_shard(dirs: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(dirs["llama_sharded"], broken)
    (broken / "pytorch_model-00002-of-00003.bin").unlink()
    with pytest.raises(ValueError, match=r"lists shards that are missing: pytorch_model-00002"):
        weight_format(broken)


def test_bin_files_that_are_not_state_dicts(tmp_path: Path) -> None:
    """``weights_only`` refusals, other objects and unreadable files: ``ValueError``s naming
    the file; a legacy (non-zip) file is read without mmap."""
    pickled = tmp_path / "pickled.bin"
    torch.save({"w": torch.ones(2), "args": TrainingArguments()}, pickled)
    with pytest.raises(ValueError, match=r"pickled\.bin is not a plain state dict.*Unsupported"):
        load_bin_state_dict(pickled)
    training = tmp_path / "training.bin"
    torch.save({"model": {"w": torch.ones(2)}, "step": 3}, training)
    with pytest.raises(ValueError, match=r"training\.bin: entry 'model' is a dict, not a tensor"):
        load_bin_state_dict(training)
    listed = tmp_path / "list.bin"
    torch.save([torch.ones(2)], listed)
    with pytest.raises(ValueError, match=r"list\.bin holds a list, not a state dict"):
        load_bin_state_dict(listed)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"garbage\.bin"):
        load_bin_state_dict(garbage)
    legacy = tmp_path / "legacy.bin"
    torch.save({"w": torch.arange(3.0)}, legacy, _use_new_zipfile_serialization=False)
    assert torch.equal(load_bin_state_dict(legacy)["w"], torch.arange(3.0))


def test_a_refused_bin_fails_the_engine_start(dirs: dict[str, Path], tmp_path: Path) -> None:
    bad = save_as_bin(dirs["llama"], tmp_path / "bad")
    torch.save({"w": TrainingArguments()}, bad / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin is not a plain state dict"):
        LLM(str(bad), max_model_len=64)


# -- hub download -----------------------------------------------------------------------------


class FakeHub:
    """``snapshot_download`` over a fake repository listing: copies the files the allow
    patterns match into one snapshot folder (as the HF cache accumulates them)."""

    def __init__(self, files: list[str], snapshot: Path, config: Path) -> None:
        self.files, self.snapshot, self.config = files, snapshot, config
        self.calls: list[list[str]] = []

    def __call__(self, repo_id: str, allow_patterns: list[str], **kwargs: Any) -> str:
        self.calls.append(list(allow_patterns))
        self.snapshot.mkdir(exist_ok=True)
        for name in self.files:
            if any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                target = self.snapshot / name
                if name == "config.json":
                    shutil.copy(self.config, target)
                elif name.endswith(".index.json"):
                    shards = [f for f in self.files if fnmatch.fnmatch(f, "pytorch_model-*.bin")]
                    target.write_text(json.dumps({"weight_map": {f: f for f in shards}}))
                else:
                    target.write_bytes(b"x")
        return str(self.snapshot)

    def fetched(self) -> set[str]:
        return {p.name for p in self.snapshot.iterdir()}


@pytest.mark.parametrize(
    ("files", "load_format", "calls", "weights"),
    [
        # safetensors present: auto fetches them, and no .bin
        (["model.safetensors", "pytorch_model.bin"], "auto", 1, {"model.safetensors"}),
        # .bin only: auto falls back to pytorch_model*.bin, never training_args.bin
        (
            ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"],
            "auto",
            2,
            {"pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"},
        ),
        (["model.safetensors", "pytorch_model.bin"], "pt", 1, {"pytorch_model.bin"}),
        (["model.safetensors", "pytorch_model.bin"], "safetensors", 1, {"model.safetensors"}),
        (["pytorch_model.bin"], "safetensors", 1, set()),
    ],
)
def test_hub_download_picks_the_weight_files(
    dirs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    files: list[str],
    load_format: str,
    calls: int,
    weights: set[str],
) -> None:
    import huggingface_hub

    from chassis.core.model_loader import resolve_model_path

    listing = [*files, "config.json", "tokenizer.json", "training_args.bin", "optimizer.bin"]
    listing += ["pytorch_model.bin.index.json"] if "00002" in " ".join(files) else []
    hub = FakeHub(listing, tmp_path / "snapshot", dirs["llama"] / "config.json")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    path = resolve_model_path("org/model", load_format=load_format)
    assert path == hub.snapshot and len(hub.calls) == calls
    fetched = hub.fetched()
    assert {f for f in fetched if f.endswith((".bin", ".safetensors"))} == weights
    assert {"config.json", "tokenizer.json"} <= fetched


# -- LoRA adapters ----------------------------------------------------------------------------


def test_peft_adapter_saved_as_bin(dirs: dict[str, Path], tmp_path: Path) -> None:
    """An ``adapter_model.bin`` adapter gives the tokens of its safetensors twin (which differ
    from the base model's)."""
    base = dirs["llama"]
    st_adapter = write_peft_adapter(tmp_path / "st", base, rank=4, magnitude=0.5)
    bin_adapter = tmp_path / "bin"
    shutil.copytree(st_adapter, bin_adapter)
    torch.save(load_file(bin_adapter / "adapter_model.safetensors"), bin_adapter / "a.bin")
    (bin_adapter / "adapter_model.safetensors").unlink()
    (bin_adapter / "a.bin").rename(bin_adapter / "adapter_model.bin")
    llm = lora_engine(base, max_lora_rank=8)
    prompts = [[1, 450, 7483, 310, 3444, 338]] * 3
    loras = [None, LoRARequest("st", 1, str(st_adapter)), LoRARequest("bin", 2, str(bin_adapter))]
    plain, with_st, with_bin = greedy_with_adapters(llm, loras, prompts, MAX_TOKENS)
    assert with_bin == with_st != plain
    torch.save({"w": TrainingArguments()}, bin_adapter / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"adapter_model\.bin is not a plain state dict"):
        llm.generate(prompts[:1], lora_request=LoRARequest("bad", 3, str(bin_adapter)))
