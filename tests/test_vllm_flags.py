"""vLLM's command-line flags that chassis takes as vLLM does: ``--config FILE`` (YAML),
``--trust-remote-code``, ``--download-dir``, ``--tokenizer-mode``, ``--scheduling-policy`` and
``--pipeline-parallel-size``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from chassis.core.config import EngineConfig
from chassis.core.llm import LLM
from chassis.core.sampling_params import SamplingParams
from chassis.core.tokenizer import engine_tokenizer
from chassis.serve import cli
from chassis.serve.args import engine_config_from_args

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _parse(argv: list[str]):
    parser = cli.build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        args = cli._with_config_file(parser, args, argv)
    return args


def _config_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


# -- --config --------------------------------------------------------------------------------


def test_config_file_values_fill_in_what_the_command_line_leaves_out(tmp_path: Path) -> None:
    path = _config_file(
        tmp_path,
        "model: org/from-file\n"
        "port: 8123\n"
        "max_model_len: 512\n"
        "enable-prefix-caching: false\n"
        "enforce_eager: false\n"
        "served_model_name: [smol, default]\n"
        "speculative_config: {method: ngram, num_speculative_tokens: 3}\n"
        "trust_remote_code: true\n"
        "api_key: secret\n",
    )
    args = _parse(["serve", "--config", path])
    assert args.model_flag == "org/from-file" and args.port == 8123
    config = engine_config_from_args(args)
    assert config.model == "org/from-file" and config.max_model_len == 512
    assert config.enable_prefix_caching is False and config.enforce_eager is False
    assert config.served_model_name == "smol" and args.served_model_name == ["smol", "default"]
    assert config.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert config.trust_remote_code is True and args.api_key == "secret"
    # the command line wins, in either spelling, and its MODEL replaces the file's
    args = _parse(["serve", "mine", "--config", path, "--port", "9", "--max-model-len=64"])
    assert (args.model, args.model_flag, args.port, args.max_model_len) == ("mine", None, 9, 64)
    assert args.enable_prefix_caching is False  # still the file's
    args = _parse(["serve", "--config", path, "--enable-prefix-caching"])
    assert args.enable_prefix_caching is True
    # a flag of the same destination on the command line wins too
    other = _config_file(tmp_path, "disable_log_stats: true\n")
    assert _parse(["serve", "--config", other, "--stat-loggers", "logging"]).stat_loggers == [
        "logging"
    ]
    assert _parse(["serve", "--config", other]).stat_loggers == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("no_such_flag: 1\n", "'no_such_flag' is not a flag of this command"),
        ("- port\n- 8000\n", "must be a mapping of flag names to values"),
        ("port: [1, 2\n", "not valid YAML"),
        ("enforce_eager: yes please\n", "--enforce-eager is a switch: give true or false"),
        ("port: [1, 2]\n", "--port takes one value, not a list"),
        ("port: eighty\n", "invalid int value: 'eighty'"),
        ("config: other.yaml\n", "cannot name another"),
    ],
)
def test_a_bad_config_file_ends_the_command_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = _config_file(tmp_path, text)
    with pytest.raises(SystemExit) as info:
        _parse(["serve", "--config", path])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_config_file_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--config", "/no/such/config.yaml"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--config /no/such/config.yaml: cannot read it" in err


def test_bench_takes_a_config_file_too(tmp_path: Path) -> None:
    path = _config_file(tmp_path, "max_num_seqs: 7\nload_format: dummy\n")
    args = _parse(["bench", "throughput", "--config", path, "--num-prompts", "3"])
    config = engine_config_from_args(args)
    assert config.max_num_seqs == 7 and config.load_format == "dummy"


# -- --scheduling-policy, --pipeline-parallel-size --------------------------------------------


def test_scheduling_policy_names_the_built_in_scheduler() -> None:
    assert (
        engine_config_from_args(_parse(["serve", "--scheduling-policy", "priority"])).scheduler
        == "priority"
    )
    assert (
        engine_config_from_args(_parse(["serve", "--scheduling-policy", "fcfs"])).scheduler
        == "fcfs"
    )
    same = _parse(["serve", "--scheduling-policy", "priority", "--scheduler", "priority"])
    assert engine_config_from_args(same).scheduler == "priority"
    with pytest.raises(
        ValueError, match="--scheduling-policy priority and --scheduler fcfs disagree"
    ):
        engine_config_from_args(
            _parse(["serve", "--scheduling-policy", "priority", "--scheduler", "fcfs"])
        )


def test_pipeline_parallel_size_reaches_the_config() -> None:
    assert engine_config_from_args(_parse(["serve", "-pp", "1"])).pipeline_parallel_size == 1
    config = engine_config_from_args(_parse(["serve", "--pipeline-parallel-size", "2"]))
    assert config.pipeline_parallel_size == 2 and config.world_size == 2
    # (stages with tensor-parallel ranks are not supported yet: tests/test_pipeline_parallel.py)
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2 cannot be combined"):
        engine_config_from_args(_parse(["serve", "-pp", "2", "-tp", "2"]))


# -- --tokenizer-mode ------------------------------------------------------------------------


def test_tokenizer_mode(
    smol_tokenizer_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SystemExit):
        _parse(["serve", "--tokenizer-mode", "mistral"])
    assert "invalid choice: 'mistral'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--tokenizer-mode must be one of auto, hf, slow"):
        EngineConfig(tokenizer_mode="fast")
    # what each mode asks of transformers (with transformers 5 both kinds of request load
    # the same backend for this tokenizer, so the encodings below cannot tell them apart)
    from transformers import AutoTokenizer

    asked: list[bool] = []
    load = AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        asked.append(kwargs["use_fast"])
        return load(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    text = "Hello wörld, 123"
    encoded = {
        mode: engine_tokenizer(
            EngineConfig(tokenizer=str(smol_tokenizer_dir), tokenizer_mode=mode)
        ).encode(text)
        for mode in ("auto", "hf", "slow")
    }
    assert encoded["auto"] == encoded["hf"] == encoded["slow"] and len(encoded["auto"]) > 3
    assert asked == [True, True, False]


# -- --trust-remote-code ---------------------------------------------------------------------

_CUSTOM_CONFIG = '''
from transformers import LlamaConfig


class ChassisTestLlamaConfig(LlamaConfig):
    """A config class that only the checkpoint's own code defines."""

    model_type = "chassis_test_llama"
'''


def test_trust_remote_code_runs_the_checkpoint_s_config_code(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    custom = tmp_path / "custom"
    shutil.copytree(tiny_llama_dir, custom)
    config = json.loads((custom / "config.json").read_text())
    config["model_type"] = "chassis_test_llama"
    config["auto_map"] = {"AutoConfig": "configuration_chassis_test.ChassisTestLlamaConfig"}
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "configuration_chassis_test.py").write_text(_CUSTOM_CONFIG)
    settings = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 32}
    with pytest.raises(ValueError, match="trust_remote_code"):
        LLM(str(custom), **settings)
    trusted = LLM(str(custom), trust_remote_code=True, **settings)
    plain = LLM(str(tiny_llama_dir), **settings)
    got = trusted.generate("The custom config", GREEDY)[0].outputs[0].token_ids
    assert got == plain.generate("The custom config", GREEDY)[0].outputs[0].token_ids
    trusted.shutdown()
    plain.shutdown()


# -- --download-dir --------------------------------------------------------------------------


def test_download_dir_is_where_hub_models_are_found(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "downloads" / "models--chassis-test--tiny-llama"
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    settings = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 32}
    with pytest.raises(ValueError, match="cannot be downloaded"):  # not in the HF cache
        LLM("chassis-test/tiny-llama", **settings)
    llm = LLM("chassis-test/tiny-llama", download_dir=str(tmp_path / "downloads"), **settings)
    assert llm.config.model == str(repo / "snapshots" / commit)
    assert len(llm.generate("From the download dir", GREEDY)[0].outputs[0].token_ids) == 6
    llm.shutdown()


# -- vLLM's other names for chassis' flags -----------------------------------------------------


def test_vllm_s_names_of_chassis_flags() -> None:
    args = _parse(
        [
            "serve",
            "--num-gpu-blocks-override",
            "9",
            "--override-pooler-config",
            '{"normalize": false}',
            "--guided-decoding-backend",
            "auto",
            "--disable-uvicorn-access-log",
            "--tokenizer-revision",
            "v1",
            "-dp",
            "1",
        ]
    )
    config = engine_config_from_args(args)
    assert config.num_kv_blocks == 9 and config.pooler_config == {"normalize": False}
    assert config.structured_output_backend == "chassis"  # vLLM's "auto": the default
    assert config.tokenizer_revision == "v1" and args.disable_access_log is True
    auto = EngineConfig(structured_outputs_config={"backend": "auto"})
    assert auto.structured_output_backend == "chassis"
    # (data parallelism itself: tests/test_data_parallel.py)
    assert engine_config_from_args(_parse(["serve", "-dp", "2"])).data_parallel_size == 2
