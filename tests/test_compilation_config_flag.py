"""vLLM's ``-O`` and ``--compilation-config`` (serve/compilation_config.py) mapped onto
chassis' ``torch_compile``/``cuda_graph_sizes``/``enforce_eager``
(core/compilation_config.py): every spelling, the config file, ``LLM(...)``, and the errors.
No engine starts except in the last test."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from chassis.core.compilation_config import (
    compilation_kwargs,
    compilation_request,
    read_compilation_config,
)
from chassis.core.config import EngineConfig
from chassis.serve import cli
from chassis.serve.args import engine_config_from_args
from chassis.serve.compilation_config import rewrite_compilation_args


def _parse(argv: list[str]) -> Any:
    parser = cli.build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        args = cli._with_config_file(parser, args, argv)
    return args


def _engine(argv: list[str]) -> tuple[bool, list[int] | None, bool]:
    """(torch_compile, cuda_graph_sizes, enforce_eager) of ``chassis serve ARGV``."""
    config = engine_config_from_args(_parse(["serve", *argv]))
    return config.torch_compile, config.cuda_graph_sizes, config.enforce_eager


DEFAULT = (False, None, False)
COMPILED = (True, None, False)
NOTHING = (False, [], False)


# -- every spelling -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], DEFAULT),
        # vLLM's optimization levels: 0 no compilation and no graphs, 1-3 both
        (["-O0"], NOTHING),
        (["-O1"], COMPILED),
        (["-O2"], COMPILED),
        (["-O3"], COMPILED),
        (["-O", "3"], COMPILED),
        (["-O=0"], NOTHING),
        (["--optimization-level", "2"], COMPILED),
        # --compilation-config / -cc: a JSON object, or an integer (its mode)
        (["--compilation-config", '{"level": 3}'], COMPILED),
        (["--compilation-config", '{"mode": 0}'], DEFAULT),  # compilation off only
        (["--compilation-config", "3"], COMPILED),
        (["-cc", '{"mode": "VLLM_COMPILE", "cudagraph_mode": "none"}'], (True, [], False)),
        (["-cc", '{"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY"}'], DEFAULT),
        (['-cc={"mode": 1}'], COMPILED),
        (["-cc", '{"mode": 3, "level": 3}'], COMPILED),  # the old and new name agree
        (["-cc", '{"mode": 3, "backend": null}'], COMPILED),  # null: vLLM's default
        (["-cc", '{"cudagraph_capture_sizes": [4, 1, 2]}'], (False, [1, 2, 4], False)),
        (["-cc", '{"cudagraph_capture_sizes": [1]}'], (False, [1], False)),
        (["-cc", '{"cudagraph_capture_sizes": []}'], NOTHING),
        (["-cc", '{"max_cudagraph_capture_size": 16}'], (False, [16], False)),
        (
            ["-cc", '{"cudagraph_capture_sizes": [1, 8], "max_cudagraph_capture_size": 8}'],
            (False, [1, 8], False),
        ),
        # older vLLM's -O JSON
        (["-O", '{"level": 3, "cudagraph_capture_sizes": [1, 2, 4]}'], (True, [1, 2, 4], False)),
        # the dotted keys, merged into one config
        (["-O.mode=3", "-O.cudagraph_capture_sizes=[1,2,4]"], (True, [1, 2, 4], False)),
        (["-cc.mode", "0", "-cc.max_cudagraph_capture_size", "16"], (False, [16], False)),
        (["-cc.cudagraph_mode=NONE", "-cc.mode=VLLM_COMPILE"], (True, [], False)),
        (["--compilation-config.mode=2"], COMPILED),
        (
            ["-cc.cudagraph_capture_sizes+=1,2", "-cc.cudagraph_capture_sizes+", "8"],
            (False, [1, 2, 8], False),
        ),
        (["-cc.mode=3", "-cc", '{"cudagraph_capture_sizes": [2, 4]}'], (True, [2, 4], False)),
        (["-cc.mode=3", "-cc.mode=3"], COMPILED),  # the same value twice is no conflict
        # a level's defaults give way to the config's keys (vLLM's rule)
        (["-O3", "-cc.cudagraph_mode=NONE"], (True, [], False)),
        (["-O3", "-cc.mode=0"], DEFAULT),
        (["-O0", "-cc.cudagraph_mode=FULL"], (False, None, False)),
        (["-O0", "-cc.max_cudagraph_capture_size=8"], (False, [8], False)),
        # chassis' own flags that agree
        (["-O3", "--torch-compile"], COMPILED),
        (["-O0", "--enforce-eager"], (False, [], True)),
        (["-O3", "--cuda-graph-sizes", "8"], (True, [8], False)),
        (["-cc.max_cudagraph_capture_size=8", "--cuda-graph-sizes", "8"], (False, [8], False)),
        (
            ["-cc.cudagraph_capture_sizes=[4,2]", "--cuda-graph-sizes", "2", "4"],
            (False, [2, 4], False),
        ),
        (["-cc.mode=0", "--enforce-eager"], (False, None, True)),
    ],
)
def test_each_spelling_maps_onto_chassis_settings(
    argv: list[str], expected: tuple[bool, list[int] | None, bool]
) -> None:
    assert _engine(argv) == expected


def test_the_parsed_values() -> None:
    args = _parse(["serve", "-O", "2", "-cc.mode=3", "-cc", '{"cudagraph_mode": "full"}'])
    assert args.optimization_level == 2
    assert args.compilation_config == {"mode": 3, "cudagraph_mode": "full"}
    assert _parse(["serve"]).compilation_config is None


@pytest.mark.parametrize("kind", ["throughput", "latency", "step"])
def test_bench_commands_take_them_too(kind: str) -> None:
    args = _parse(["bench", kind, "-O3", "-cc.cudagraph_capture_sizes=[1,2]"])
    config = engine_config_from_args(args)
    assert config.torch_compile is True and config.cuda_graph_sizes == [1, 2]


def test_rewrite_keeps_other_tokens() -> None:
    rewritten = rewrite_compilation_args(
        ["serve", "m", "-O3", "--port", "1", "-cc.mode", "3", "-cc=3", "--", "-O1"]
    )
    assert rewritten == [
        "serve",
        "m",
        "--optimization-level",
        "3",
        "--port",
        "1",
        "--compilation-config",
        "3",
        "--compilation-config",
        '{"mode": 3}',
        "--",
        "-O1",
    ]
    # -O's value is the level; a JSON object is older vLLM's compilation config
    assert rewrite_compilation_args(["-O", "x"]) == ["--optimization-level", "x"]
    assert rewrite_compilation_args(["-O{}"]) == ["--compilation-config", "{}"]


# -- the config file ----------------------------------------------------------------------------


def test_config_file(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "compilation_config: {mode: 3, cudagraph_capture_sizes: [1, 2, 4]}\noptimization-level: 0\n"
    )
    args = _parse(["serve", "--config", str(path)])
    assert args.compilation_config == {"mode": 3, "cudagraph_capture_sizes": [1, 2, 4]}
    assert args.optimization_level == 0
    config = engine_config_from_args(args)
    assert (config.torch_compile, config.cuda_graph_sizes) == (True, [1, 2, 4])
    # the command line wins, whichever spelling it uses
    args = _parse(["serve", "--config", str(path), "-O3", "-cc.mode=0"])
    assert args.optimization_level == 3 and args.compilation_config == {"mode": 0}
    config = engine_config_from_args(args)
    assert (config.torch_compile, config.cuda_graph_sizes) == (False, None)
    other = tmp_path / "other.yaml"
    other.write_text("compilation_config: {backend: eager}\n")
    with pytest.raises(SystemExit) as info:
        _parse(["serve", "--config", str(other)])
    assert info.value.code == 2


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-O3", "--enforce-eager"], "-O3 and --enforce-eager disagree"),
        (["-O0", "--torch-compile"], "-O0 and --torch-compile disagree"),
        (["-O0", "--cuda-graph-sizes", "4"], "-O0 and --cuda-graph-sizes 4 disagree"),
        (
            ["-cc.mode=3", "--enforce-eager"],
            "--compilation-config mode=3 and --enforce-eager disagree",
        ),
        (
            ["-cc.cudagraph_mode=FULL", "--enforce-eager"],
            "--compilation-config cudagraph_mode=FULL and --enforce-eager disagree",
        ),
        (
            ["-cc.cudagraph_mode=NONE", "--cuda-graph-sizes", "8"],
            "--compilation-config cudagraph_mode=NONE and --cuda-graph-sizes 8 disagree",
        ),
        (
            ["-cc", '{"cudagraph_capture_sizes": [1, 2]}', "--cuda-graph-sizes", "8"],
            "--compilation-config cudagraph_capture_sizes=[1, 2] and --cuda-graph-sizes 8 "
            "disagree: they ask for different capture sizes",
        ),
        (
            ["-cc.max_cudagraph_capture_size=16", "--cuda-graph-sizes", "8"],
            "--compilation-config max_cudagraph_capture_size=16 and --cuda-graph-sizes 8",
        ),
    ],
)
def test_a_chassis_flag_that_disagrees_is_one_error_naming_both(
    argv: list[str], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match="disagree") as info:
        engine_config_from_args(_parse(["serve", *argv]))
    assert message in str(info.value) and str(info.value).endswith("give one")
    # chassis serve: one error line, exit status 2, before any model loads
    with caplog.at_level(logging.ERROR, logger="chassis.serve"):
        assert cli.main(["serve", *argv]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [str(info.value)]


@pytest.mark.parametrize("kind", ["latency", "step"])
def test_bench_reports_a_disagreement_with_status_2(
    kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", kind, "-O1", "--enforce-eager"]) == 2
    assert capsys.readouterr().err.strip() == (
        "chassis bench: -O1 and --enforce-eager disagree: -O1 compiles the model's forward, "
        "--enforce-eager compiles nothing; give one"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-O5"], "argument -O/--optimization-level: invalid choice: 5 (choose from 0, 1, 2, 3)"),
        (["-O", "fast"], "argument -O/--optimization-level: invalid int value: 'fast'"),
        (["-cc", "{mode: 3}"], "argument --compilation-config/-cc: not JSON: Expecting"),
        (["-cc", "[1, 2]"], "must be a JSON object of vLLM's CompilationConfig keys"),
        (["-O", '{"level": 3'], "argument --compilation-config/-cc: not JSON"),
        (
            ["-cc.backend=eager"],
            "--compilation-config: key 'backend' not supported; chassis maps mode, level, "
            "cudagraph_mode, cudagraph_capture_sizes, max_cudagraph_capture_size",
        ),
        (
            ["-cc", '{"pass_config": {"fuse_norm_quant": true}, "custom_ops": ["none"]}'],
            "--compilation-config: keys 'pass_config', 'custom_ops' not supported",
        ),
        (["-cc.mode=4"], "--compilation-config: mode must be 0, 1, 2, 3 or one of NONE, "),
        (["-cc.level=true"], "--compilation-config: level must be 0, 1, 2, 3"),
        (["-cc", '{"mode": 1, "level": 0}'], "mode 1 and level 0 disagree"),
        (["-cc.cudagraph_mode=SOME"], "cudagraph_mode must be one of NONE, PIECEWISE, FULL, "),
        (["-cc.cudagraph_capture_sizes=[1,0]"], "cudagraph_capture_sizes must be a list of"),
        (["-cc.cudagraph_capture_sizes=8"], "cudagraph_capture_sizes must be a list of"),
        (["-cc.max_cudagraph_capture_size=0"], "max_cudagraph_capture_size must be an integer"),
        (
            ["-cc.cudagraph_capture_sizes=[8]"],
            "cudagraph_capture_sizes [8] is one batch size; chassis captures exactly the "
            "sizes listed only for two or more",
        ),
        (
            ["-cc", '{"cudagraph_capture_sizes": [1, 2], "max_cudagraph_capture_size": 4}'],
            "max_cudagraph_capture_size 4 must be the largest of cudagraph_capture_sizes",
        ),
        (
            ["-cc", '{"cudagraph_mode": "NONE", "cudagraph_capture_sizes": [1, 2]}'],
            "cudagraph_mode=NONE and cudagraph_capture_sizes=[1, 2] disagree",
        ),
        (
            ["-cc", '{"cudagraph_mode": "FULL", "cudagraph_capture_sizes": []}'],
            "cudagraph_mode=FULL and cudagraph_capture_sizes=[] disagree",
        ),
        (["-cc.mode=3", "-cc.mode=0"], "-cc.mode=0: mode is given twice, as 3 and 0"),
        (["-cc", '{"mode": 3}', "-cc", '{"mode": 0}'], "mode given twice, as 3 and 0"),
        (["-O.mode"], "-O.mode needs a value"),
        (["-cc..mode=3"], "a key is empty"),
    ],
)
def test_bad_values_stop_the_parser_with_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        _parse(["serve", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


# -- the mapping itself and LLM(...) --------------------------------------------------------------


def test_read_compilation_config() -> None:
    request = read_compilation_config({"mode": "stock_torch_compile"})
    assert request.compile == (True, "--compilation-config mode=stock_torch_compile")
    assert request.graphs is None and request.sizes is None
    request = read_compilation_config(0)
    assert request.compile == (False, "--compilation-config mode=0") and request.graphs is None
    request = read_compilation_config({"cudagraph_capture_sizes": [8, 2, 2]})
    assert request.sizes == ([2, 8], "--compilation-config cudagraph_capture_sizes=[8, 2, 2]")
    assert request.graphs == (True, request.sizes.source)
    assert compilation_request(None, 0).graphs == (False, "-O0")
    for bad in ("3", [3], True, 2.0):
        with pytest.raises(ValueError, match="must be a mapping of vLLM's CompilationConfig"):
            read_compilation_config(bad)


def test_llm_arguments_map_the_same_way() -> None:
    assert compilation_kwargs({"dtype": "float32"}) == {"dtype": "float32"}
    assert compilation_kwargs({"compilation_config": 3}) == {"torch_compile": True}
    assert compilation_kwargs({"optimization_level": 0}) == {
        "torch_compile": False,
        "cuda_graph_sizes": [],
    }
    kwargs = compilation_kwargs(
        {"compilation_config": {"cudagraph_mode": "NONE", "level": 3}, "max_num_seqs": 4}
    )
    assert kwargs == {"torch_compile": True, "cuda_graph_sizes": [], "max_num_seqs": 4}
    assert EngineConfig(**kwargs).cuda_graph_sizes == []
    with pytest.raises(
        ValueError, match="optimization_level=3 and --enforce-eager disagree: optimization_level"
    ):
        compilation_kwargs({"optimization_level": 3, "enforce_eager": True})
    with pytest.raises(ValueError, match="compilation_config mode=0 and --torch-compile disagree"):
        compilation_kwargs({"compilation_config": {"mode": 0}, "torch_compile": True})
    with pytest.raises(ValueError, match="compilation_config mode=3 and torch_compile=False"):
        compilation_kwargs({"compilation_config": 3, "torch_compile": False})
    with pytest.raises(ValueError, match=r"and cuda_graph_sizes=\[\] disagree"):
        compilation_kwargs(
            {"compilation_config": {"cudagraph_mode": "FULL"}, "cuda_graph_sizes": []}
        )
    with pytest.raises(ValueError, match=r"optimization_level must be 0, 1, 2 or 3.*got 4"):
        compilation_kwargs({"optimization_level": 4})
    with pytest.raises(ValueError, match="compilation_config: key 'backend' not supported"):
        compilation_kwargs({"compilation_config": {"backend": "eager"}})


def test_llm_takes_compilation_config(tiny_llama_dir: Path) -> None:
    from chassis import LLM

    with pytest.raises(ValueError, match="compilation_config mode=3 and --enforce-eager"):
        LLM(str(tiny_llama_dir), compilation_config={"mode": 3}, enforce_eager=True)
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=32,
        compilation_config={"mode": 0, "cudagraph_capture_sizes": [1, 2]},
    )
    assert llm.config.torch_compile is False and llm.config.cuda_graph_sizes == [1, 2]
    llm.shutdown()
