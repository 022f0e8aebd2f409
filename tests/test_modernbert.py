"""ModernBERT encoders: ``ModernBertModel`` embeddings (``LLM.embed``) and
``ModernBertForSequenceClassification`` scores and classes (``LLM.score`` / ``classify``,
``classifier_pooling`` "cls" and "mean") against HF transformers (float32, tiny random
checkpoints, tolerance 1e-5), prompts of different lengths in one step and over several,
longer than the local layers' window; a masked-LM checkpoint (ModernBERT-base's layout)
served as ``ModernBertModel``; the symmetric window of
:func:`~chassis.core.encoder_only.bidirectional_attention`; and what is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from bert_checkpoints import hf_hidden_states
from encoder_checkpoints import MODERNBERT_MAX_DISTANCE, write_modernbert
from test_bert_embeddings import _metadata

from chassis.core.encoder_only import bidirectional_attention
from chassis.core.llm import LLM
from chassis.core.pooling_params import PoolingParams

TOL = 1e-5
#: 3 to 32 tokens with [CLS] and [SEP]: most longer than the window (4 places each side)
PROMPTS = [
    "hello world",
    "The cat sat on the mat, the dog was good",
    " ".join(["a long and winding sentence"] * 6),
    "paris",
    "what is the capital of france?",
]
QUERY = "what is the capital of france?"
DOCUMENTS = [
    "paris is the capital of france",
    "the cat sat on the mat and the dog sat on the long mat",
    "hello",
]


@pytest.fixture(scope="module")
def modernbert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_modernbert(tmp_path_factory.mktemp("modernbert"))


@pytest.fixture(scope="module")
def hf_states(modernbert_dir: Path) -> list[torch.Tensor]:
    return hf_hidden_states(modernbert_dir, PROMPTS)


def _llm(model_dir: Path, **kwargs: Any) -> LLM:
    return LLM(str(model_dir), dtype="float32", **kwargs)


def _pooled(states: torch.Tensor, pooling_type: str) -> torch.Tensor:
    vector = states[0] if pooling_type == "CLS" else states.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0)


@pytest.mark.parametrize(
    ("pooling_type", "budget"),
    [("CLS", 256), ("CLS", 40), ("MEAN", 256)],
    ids=["cls_one_step", "cls_several_steps", "mean_one_step"],
)
def test_embeddings_match_hf(
    pooling_type: str, budget: int, modernbert_dir: Path, hf_states: list[torch.Tensor]
) -> None:
    pooler = None if pooling_type == "CLS" else {"pooling_type": pooling_type}
    llm = _llm(
        modernbert_dir, max_num_batched_tokens=budget, max_model_len=40, pooler_config=pooler
    )
    assert llm.config.runner == "pooling"
    assert llm.pooler_config.pooling_type == pooling_type  # CLS: the model's default
    assert not llm.config.enable_chunked_prefill and not llm.config.enable_prefix_caching
    outputs = llm.embed(PROMPTS)
    assert max(len(o.prompt_token_ids) for o in outputs) > 2 * MODERNBERT_MAX_DISTANCE + 1
    for output, states in zip(outputs, hf_states, strict=True):
        assert len(output.prompt_token_ids) == states.shape[0]
        torch.testing.assert_close(
            torch.tensor(output.outputs.embedding),
            _pooled(states, pooling_type),
            atol=TOL,
            rtol=0,
        )


def test_local_window_matters(modernbert_dir: Path, hf_states: list[torch.Tensor]) -> None:
    """HF's model with a local window wider than every prompt gives the long prompt other
    hidden states: the parity above checks the symmetric window."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(modernbert_dir, dtype=torch.float32, local_attention=1000)
    tokenizer = AutoTokenizer.from_pretrained(modernbert_dir)
    with torch.inference_mode():
        wide = model.eval()(**tokenizer(PROMPTS[2], return_tensors="pt")).last_hidden_state[0]
    assert float((wide - hf_states[2]).abs().max()) > 1e-2


def _hf_logits(model_dir: Path, first: str, second: str | None = None) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        return model.eval()(**tokenizer(first, second, return_tensors="pt")).logits[0]


@pytest.mark.parametrize("classifier_pooling", ["cls", "mean"])
def test_cross_encoder_scores_match_hf(classifier_pooling: str, tmp_path: Path) -> None:
    model_dir = write_modernbert(
        tmp_path / "ce", num_labels=1, classifier_pooling=classifier_pooling, seed=21
    )
    llm = _llm(model_dir, max_num_batched_tokens=40)
    assert llm.config.runner == "pooling" and llm.pooler_config.pooling_type == "CLS"
    outputs = llm.score(QUERY, DOCUMENTS)
    raw = llm.score(QUERY, DOCUMENTS, pooling_params=PoolingParams(use_activation=False))
    logits = []
    for output, logit, document in zip(outputs, raw, DOCUMENTS, strict=True):
        expected = _hf_logits(model_dir, QUERY, document)[0]
        assert logit.outputs.score == pytest.approx(float(expected), abs=TOL)
        assert output.outputs.score == pytest.approx(float(torch.sigmoid(expected)), abs=TOL)
        logits.append(logit.outputs.score)
    assert max(logits) - min(logits) > 0.1  # the pairs differ: not a constant head


@pytest.mark.parametrize("classifier_pooling", ["cls", "mean"])
def test_classify_matches_hf(classifier_pooling: str, tmp_path: Path) -> None:
    model_dir = write_modernbert(
        tmp_path / "cls3", num_labels=3, classifier_pooling=classifier_pooling, seed=22
    )
    llm = _llm(model_dir, max_num_batched_tokens=40)
    for output, text in zip(llm.classify(PROMPTS), PROMPTS, strict=True):
        expected = torch.softmax(_hf_logits(model_dir, text), dim=0)
        torch.testing.assert_close(torch.tensor(output.outputs.probs), expected, atol=TOL, rtol=0)


def test_masked_lm_checkpoint_as_model(tmp_path: Path) -> None:
    """ModernBERT-base's layout (``ModernBertForMaskedLM``: the encoder under ``model.``,
    a prediction head and decoder) served as ``ModernBertModel``: HF's base model of the
    same checkpoint."""
    model_dir = write_modernbert(tmp_path / "mlm", masked_lm=True, seed=23)
    llm = _llm(
        model_dir,
        hf_overrides={"architectures": ["ModernBertModel"]},
        pooler_config={"pooling_type": "MEAN"},
    )
    outputs = llm.embed(PROMPTS[:3])
    for output, states in zip(outputs, hf_hidden_states(model_dir, PROMPTS[:3]), strict=True):
        torch.testing.assert_close(
            torch.tensor(output.outputs.embedding), _pooled(states, "MEAN"), atol=TOL, rtol=0
        )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tensor_parallel_size": 2}, "cannot be sharded"),
        ({"runner": "generate"}, "ModernBertModel is an encoder-only"),
        ({"hf_overrides": {"hidden_activation": "tanh"}}, "hidden_activation 'tanh'"),
        (
            {
                "hf_overrides": {
                    "rope_parameters": {
                        "full_attention": {"rope_type": "linear", "factor": 2.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                    }
                }
            },
            "ModernBERT RoPE type 'linear'",
        ),
    ],
)
def test_refused(modernbert_dir: Path, settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _llm(modernbert_dir, **settings)


def test_symmetric_window_within_each_request() -> None:
    """``bidirectional_attention(max_distance=d)``: each token attends to the tokens of its
    own request at most ``d`` places away, for one request and for several padded."""
    torch.manual_seed(0)
    for lengths in ([11], [5, 1, 12, 9]):
        q, k, v = (torch.randn(sum(lengths), 2, 8) for _ in range(3))
        out = bidirectional_attention(q, k, v, _metadata(lengths), 0.3, max_distance=3)
        start = 0
        for n in lengths:
            part = slice(start, start + n)
            index = torch.arange(n)
            band = (index[:, None] - index[None, :]).abs() <= 3
            expected = torch.nn.functional.scaled_dot_product_attention(
                q[part].transpose(0, 1),
                k[part].transpose(0, 1),
                v[part].transpose(0, 1),
                attn_mask=band,
                scale=0.3,
            ).transpose(0, 1)
            torch.testing.assert_close(out[part], expected, atol=1e-6, rtol=0)
            start += n
