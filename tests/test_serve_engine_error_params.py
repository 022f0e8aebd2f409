"""The engine's ``ValueError``s about a request's token ids become 400s whose ``param``
names the field the client sent (``prompt``, ``logit_bias``, ``stop_token_ids``); they had
``param: null``, so a client could not tell which list held the id. The messages are the
real input processor's."""

from __future__ import annotations

from typing import Any

import pytest

from chassis.core.config import EngineConfig
from chassis.core.input_processor import InputProcessor
from chassis.core.sampling_params import SamplingParams
from chassis.serve.errors import to_api_error

EOS = 2


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([5, 49152, -1], {}, "prompt"),
        ([5, 1.5], {}, "prompt"),
        ("Hi", {"logit_bias": {10**6: 1.0}}, "logit_bias"),
        ("Hi", {"stop_token_ids": [10**6]}, "stop_token_ids"),
        ("Hi", {"logprobs": 6}, "logprobs"),
    ],
)
def test_engine_refusals_name_the_field(
    smol_tokenizer: Any, prompt: Any, params: dict[str, Any], param: str
) -> None:
    processor = InputProcessor(
        smol_tokenizer, EngineConfig(max_model_len=64, max_logprobs=5), [EOS]
    )
    with pytest.raises(ValueError) as refused:
        processor.process(prompt, SamplingParams(**params), "r")
    error = to_api_error(refused.value)
    assert error.status == 400
    assert error.param == param, error.message
    assert error.message == str(refused.value)


def test_a_priority_the_scheduler_ignores_names_priority(smol_tokenizer: Any) -> None:
    processor = InputProcessor(smol_tokenizer, EngineConfig(max_model_len=64), [EOS])
    with pytest.raises(ValueError) as refused:
        processor.process("Hi", SamplingParams(), "r", priority=5)
    error = to_api_error(refused.value)
    assert (error.status, error.param) == (400, "priority"), error.message


def test_an_embedding_inputs_ids_out_of_the_vocabulary_name_input(smol_tokenizer: Any) -> None:
    from chassis.core.pooling_input import EmbeddingModelInfo, process_pooling
    from chassis.core.pooling_params import PoolingParams

    processor = InputProcessor(smol_tokenizer, EngineConfig(max_model_len=64), [EOS])
    info = EmbeddingModelInfo(model_name="m", hidden_size=8)
    with pytest.raises(ValueError) as refused:
        process_pooling(processor, info, [5, -1], PoolingParams(), "r")
    error = to_api_error(refused.value)
    assert (error.status, error.param) == (400, "input"), error.message
