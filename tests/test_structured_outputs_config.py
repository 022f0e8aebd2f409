"""vLLM's ``--structured-outputs-config`` (``EngineConfig.structured_outputs_config``):
its keys are checked, ``backend`` agrees with ``--structured-output-backend``, and an
engine-wide ``disable_any_whitespace`` makes every JSON constraint compact unless the
request sets a whitespace option itself."""

from __future__ import annotations

import json

import pytest
from test_structured_whitespace import whitespace_outside_strings

from chassis import LLM, SamplingParams
from chassis.core.config import EngineConfig
from chassis.core.structured_output import StructuredOutputsParams
from chassis.core.structured_outputs_config import with_engine_defaults
from chassis.serve.args import engine_config_from_args
from chassis.serve.cli import build_parser

COMPACT = {"disable_any_whitespace": True}


def config_from_flags(*flags: str) -> EngineConfig:
    return engine_config_from_args(build_parser().parse_args(["serve", *flags]))


def test_the_flag_sets_the_config_and_the_backend() -> None:
    config = config_from_flags(
        "--structured-outputs-config",
        '{"backend": "chassis", "disable_any_whitespace": true, "disable_fallback": false}',
    )
    assert config.structured_outputs_config == {
        "backend": "chassis",
        "disable_any_whitespace": True,
        "disable_fallback": False,
    }
    assert config.structured_output_backend == "chassis"
    assert config_from_flags().structured_outputs_config is None


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ['{"reasoning_parser": "qwen3"}'],
            r"unknown key\(s\) reasoning_parser .*--reasoning-parser",
        ),
        (['{"disable_any_whitespace": "yes"}'], "disable_any_whitespace must be true or false"),
        (['{"disable_additional_properties": 1}'], "must be true or false"),
        (['{"backend": ""}'], "backend must be a backend plugin's name"),
        (
            ['{"backend": "xgrammar"}', "--structured-output-backend", "other"],
            "names backend 'xgrammar' and --structured-output-backend 'other'; give one",
        ),
    ],
)
def test_bad_settings_are_value_errors_naming_the_flag(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        config_from_flags("--structured-outputs-config", *flags)
    assert str(info.value).startswith("--structured-outputs-config")


def test_the_backend_key_picks_the_backend() -> None:
    config = EngineConfig(model="m", structured_outputs_config={"backend": "mine"})
    assert config.structured_output_backend == "mine"


def test_the_default_applies_to_json_constraints_without_their_own_option() -> None:
    schema = StructuredOutputsParams(json={"type": "object"})
    assert with_engine_defaults(schema, COMPACT).disable_any_whitespace
    assert with_engine_defaults(StructuredOutputsParams(json_object=True), COMPACT) == (
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    )
    patterned = StructuredOutputsParams(json_object=True, whitespace_pattern="[ ]?")
    assert with_engine_defaults(patterned, COMPACT) is patterned  # the request's own choice
    regex = StructuredOutputsParams(regex="[a-z]+")
    assert with_engine_defaults(regex, COMPACT) is regex  # not JSON: nothing to compact
    assert with_engine_defaults(schema, None) is schema
    assert with_engine_defaults(schema, {"disable_any_whitespace": False}) is schema


def test_an_engine_wide_compact_default_reaches_generation(smollm2_dir) -> None:
    """SmolLM2 under the engine default writes compact JSON for a request that asks for
    none, and the spaces a request's own whitespace_pattern demands."""
    llm = LLM(
        str(smollm2_dir),
        dtype="float32",
        max_model_len=512,
        num_kv_blocks=64,
        structured_outputs_config=COMPACT,
    )
    question = [{"role": "user", "content": "Describe a cat in JSON with its name and colour."}]
    try:
        texts = {}
        for name, options in (("default", {}), ("pattern", {"whitespace_pattern": "[ ]"})):
            params = SamplingParams(
                structured_outputs=StructuredOutputsParams(json_object=True, **options),
                temperature=0.0,
                max_tokens=80,
            )
            [output] = llm.chat(question, params)
            texts[name] = output.outputs[0]
    finally:
        llm.shutdown()
    compact = texts["default"]
    assert compact.finish_reason == "stop", compact.text
    assert isinstance(json.loads(compact.text), dict), compact.text
    assert not whitespace_outside_strings(compact.text), compact.text
    assert whitespace_outside_strings(texts["pattern"].text), texts["pattern"].text
