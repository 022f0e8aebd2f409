"""Sequence-classification models offline: ``LLM.classify`` and cross-encoder ``LLM.score``
against HF transformers' ``AutoModelForSequenceClassification`` (float32, tiny random
checkpoints), the runner chosen from the architecture, and what is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_classify import LABELS, hf_classifier

from chassis.core.llm import LLM
from chassis.core.pooling_classify import (
    ClassifierInfo,
    apply_activation,
    cross_encoder_token_ids,
    resolve_runner,
)
from chassis.core.pooling_params import PoolingParams

#: one prompt longer than the token budget (computed over several steps), short ones
PROMPTS = [
    "The movie was wonderful, I would watch it again",
    "no",
    " ".join(["a long and winding sentence"] * 8),
    "Terrible service.",
]
TOL = 1e-5


def _llm(model_dir: Path, **kwargs: Any) -> LLM:
    kwargs.setdefault("max_num_batched_tokens", 16)
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=64, **kwargs)


def _hf_logits(model: Any, tokenizer: Any, text: str, pair: str | None = None) -> torch.Tensor:
    encoded = tokenizer(text, pair, return_tensors="pt")
    with torch.inference_mode():
        return model(**encoded).logits[0]


@pytest.fixture(scope="module")
def llama_llm(tiny_llama_cls_dir: Path) -> LLM:
    return _llm(tiny_llama_cls_dir)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_classify_matches_hf(arch: str, llama_llm: LLM, tiny_qwen2_cls_dir: Path) -> None:
    from transformers import AutoTokenizer

    model_dir = Path(llama_llm.config.model) if arch == "llama" else tiny_qwen2_cls_dir
    llm = llama_llm if arch == "llama" else _llm(model_dir)
    # the runner is picked from the architecture (vLLM's --runner auto)
    assert llm.config.runner == "pooling"
    assert not llm.pooler_config.normalize and llm.pooler_config.use_activation
    hf, tokenizer = hf_classifier(model_dir), AutoTokenizer.from_pretrained(model_dir)
    outputs = llm.classify(PROMPTS)
    raw = llm.classify(PROMPTS, PoolingParams(use_activation=False))
    assert llm.classification_labels == list(LABELS)
    for prompt, out, logits_out in zip(PROMPTS, outputs, raw, strict=True):
        logits = _hf_logits(hf, tokenizer, prompt)
        assert out.outputs.num_classes == 3
        assert out.prompt_token_ids == tokenizer(prompt).input_ids
        torch.testing.assert_close(
            torch.tensor(out.outputs.probs), logits.softmax(-1), atol=TOL, rtol=0
        )
        torch.testing.assert_close(torch.tensor(logits_out.outputs.probs), logits, atol=TOL, rtol=0)
    # distinct classes win: the probabilities are not all alike
    assert len({max(range(3), key=o.outputs.probs.__getitem__) for o in outputs}) > 1


def test_classify_inputs_truncation_and_pooler_config(
    llama_llm: LLM, tiny_llama_cls_dir: Path
) -> None:
    ids = llama_llm.get_tokenizer()(PROMPTS[0]).input_ids
    by_ids = llama_llm.classify([ids, {"prompt_token_ids": ids}])
    by_text = llama_llm.classify(PROMPTS[0])
    # a batch of two and a batch of one may round differently (torch 2.11's CPU matmuls do,
    # in the 7th digit)
    for output in (by_ids[1], by_text[0]):
        assert output.outputs.probs == pytest.approx(by_ids[0].outputs.probs, rel=1e-5, abs=1e-9)
    # truncation keeps the last tokens, as for embeddings
    cut = llama_llm.classify(PROMPTS[0], truncate_prompt_tokens=4)[0]
    assert cut.prompt_token_ids == ids[-4:]
    assert cut.outputs.probs == llama_llm.classify([ids[-4:]])[0].outputs.probs
    # per-prompt params, one without the activation
    mixed = llama_llm.classify(
        [PROMPTS[0], PROMPTS[0]], [PoolingParams(), PoolingParams(use_activation=False)]
    )
    assert mixed[0].outputs.probs == pytest.approx(
        apply_activation(mixed[1].outputs.probs, "softmax"), abs=1e-6
    )
    with pytest.raises(ValueError, match="classification model"):
        llama_llm.classify("x", PoolingParams(dimensions=2))
    # the engine-wide switch (vLLM's pooler_config use_activation; older name: activation)
    raw = _llm(tiny_llama_cls_dir, pooler_config={"activation": False})
    assert raw.classify(PROMPTS[0])[0].outputs.probs == pytest.approx(
        mixed[1].outputs.probs, rel=1e-5, abs=1e-9
    )


def test_cross_encoder_score_matches_hf(tiny_qwen3_cls_dir: Path) -> None:
    from transformers import AutoTokenizer

    llm = _llm(tiny_qwen3_cls_dir, task="score")  # vLLM's older spelling
    assert llm.config.runner == "pooling"
    hf, tokenizer = (
        hf_classifier(tiny_qwen3_cls_dir),
        AutoTokenizer.from_pretrained(tiny_qwen3_cls_dir),
    )
    query = "What is the capital of France?"
    docs = ["Paris is the capital of France.", "Bananas are yellow.", PROMPTS[2]]
    scored = llm.score(query, docs)
    assert len(scored) == 3
    for doc, out in zip(docs, scored, strict=True):
        logit = _hf_logits(hf, tokenizer, query, doc)[0]
        assert out.outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=TOL)
        # the pair read as one sequence: what the tokenizer's pair encoding gives
        assert out.prompt_token_ids == tokenizer(query, doc).input_ids
    # N:N, and the raw logit without the activation
    pairs = llm.score([query, docs[1]], [docs[0], query], pooling_params=PoolingParams())
    assert pairs[0].outputs.score == scored[0].outputs.score
    raw = llm.score(query, docs[1], pooling_params=PoolingParams(use_activation=False))
    expected = _hf_logits(hf, tokenizer, query, docs[1])[0].item()
    assert raw[0].outputs.score == pytest.approx(expected, abs=TOL)
    # truncation: the tokenizer's pair truncation to k tokens
    cut = llm.score(query, docs[2], truncate_prompt_tokens=12)[0]
    encoded = tokenizer(query, docs[2], truncation=True, max_length=12, return_tensors="pt")
    assert cut.prompt_token_ids == encoded.input_ids[0].tolist()
    with torch.inference_mode():
        expected = torch.sigmoid(hf(**encoded).logits[0, 0]).item()
    assert cut.outputs.score == pytest.approx(expected, abs=TOL)
    # token ids: the two lists, one after the other
    q_ids, d_ids = tokenizer(query).input_ids, tokenizer(docs[0]).input_ids
    by_ids = llm.score({"prompt_token_ids": q_ids}, {"prompt_token_ids": d_ids})[0]
    assert by_ids.prompt_token_ids == q_ids + d_ids
    # a one-label classifier classifies too: the sigmoid of its logit
    [single] = llm.classify(query)
    assert single.outputs.num_classes == 1 and 0 < single.outputs.probs[0] < 1
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score([query, query], docs)


def test_refusals(llama_llm: LLM, tiny_llama_cls_dir: Path, tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="num_labels == 1"):
        llama_llm.score("a", "b")
    with pytest.raises(ValueError, match="use classify"):
        llama_llm.embed("a")
    with pytest.raises(ValueError, match="embed"):
        llama_llm.generate("a")
    with pytest.raises(ValueError, match="cannot generate text"):
        LLM(str(tiny_llama_cls_dir), runner="generate")
    # "auto" resolves to pooling, then what a pooling engine refuses is refused
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    with pytest.raises(ValueError, match="--speculative-config cannot be combined"):
        LLM(str(tiny_llama_cls_dir), speculative_config=ngram)
    # and "auto" on a causal model is "generate", which takes no pooler config
    with pytest.raises(ValueError, match="--pooler-config is for --runner pooling only"):
        LLM(str(tiny_llama_dir), pooler_config={"pooling_type": "MEAN"})
    # an embedding model does not classify (and keeps bi-encoder scoring)
    embedder = _llm(tiny_llama_dir, runner="pooling")
    assert embedder.classification_labels is None
    with pytest.raises(ValueError, match="use embed"):
        embedder.classify("a")
    assert -1 <= embedder.score("a", "b")[0].outputs.score <= 1


def test_classifier_info_activation_and_runner() -> None:
    from transformers import LlamaConfig

    def info(**fields: Any) -> ClassifierInfo | None:
        config = LlamaConfig(architectures=["LlamaForSequenceClassification"], **fields)
        return ClassifierInfo.from_hf_config(config)

    assert info(num_labels=3).activation == "softmax"  # type: ignore[union-attr]
    assert info(num_labels=1).activation == "sigmoid"  # type: ignore[union-attr]
    multi = info(num_labels=3, problem_type="multi_label_classification")
    assert multi is not None and multi.activation == "sigmoid" and multi.labels[0] == "LABEL_0"
    assert info(num_labels=1, problem_type="regression").activation == "identity"  # type: ignore[union-attr]
    st = info(
        num_labels=1, sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"}
    )
    assert st is not None and st.score_activation == "identity"
    assert ClassifierInfo.from_hf_config(LlamaConfig(architectures=["LlamaForCausalLM"])) is None
    assert apply_activation([0.0, 0.0], "softmax") == [0.5, 0.5]
    assert apply_activation([0.0], "sigmoid") == [0.5]
    assert resolve_runner("auto", ["Qwen2ForSequenceClassification"]) == "pooling"
    assert resolve_runner("auto", ["LlamaForCausalLM"]) == "generate"
    assert resolve_runner("pooling", ["LlamaForCausalLM"]) == "pooling"
    with pytest.raises(ValueError, match="cannot generate text"):
        resolve_runner("generate", ["Qwen3ForSequenceClassification"])
    from chassis.core.config import EngineConfig

    assert EngineConfig().runner == "auto"  # resolved once the checkpoint is read

    class NoPairs:
        """A tokenizer without pair encoding: the query's tokens, then the document's."""

        def __call__(self, text: str, text_pair: str | None = None, **kwargs: Any) -> Any:
            if text_pair is not None:
                raise TypeError("no pairs")
            special = [1] if kwargs.get("add_special_tokens", True) else []

            class Encoded:
                input_ids = special + [ord(c) for c in text]

            return Encoded()

    assert cross_encoder_token_ids(NoPairs(), "ab", "c") == [1, 97, 98, 99]
    assert cross_encoder_token_ids(None, [5, 6], [7]) == [5, 6, 7]
    with pytest.raises(ValueError, match="tokenizer"):
        cross_encoder_token_ids(None, "a", "b")
