"""Incremental detokenization and stop strings, on the real SmolLM2 tokenizer and a
sentencepiece-style byte-fallback tokenizer."""

from __future__ import annotations

import random

import pytest

from chassis.core import detokenizer as detok_mod
from chassis.core.detokenizer import IncrementalDetokenizer
from chassis.core.sampling_params import SamplingParams

TEXTS = [
    "The capital of France is Paris.",
    "Héllo wörld! naïve café, crème brûlée — «ok» · Ångström",
    "世界你好，这是一个测试。日本語のテキストも。한국어 텍스트",
    "Emoji: 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 ✨ done",
    "def f(x):\n    return x  # tabs\tand\n\nnewlines   spaces",
    "  leading spaces and trailing  ",
    "Mixed: a😀b世c\u00e9d\u0301e",
]


def stream(
    detok: IncrementalDetokenizer,
    token_ids: list[int],
    *,
    chunk: int = 1,
    finish: bool = True,
    stop_token_terminated: bool = False,
) -> list[str]:
    """Feed ``token_ids`` ``chunk`` at a time, the last call marked finished; the deltas."""
    deltas = []
    for start in range(0, len(token_ids), chunk):
        part = token_ids[start : start + chunk]
        last = start + chunk >= len(token_ids)
        deltas.append(
            detok.update(
                part,
                finished=finish and last,
                stop_token_terminated=stop_token_terminated and last,
            )
        )
    if not token_ids and finish:
        deltas.append(detok.update([], finished=True))
    return deltas


def decode(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


@pytest.fixture(params=["smol", "sp"])
def tokenizer(request, smol_tokenizer, sp_tokenizer):
    return smol_tokenizer if request.param == "smol" else sp_tokenizer


# -- the invariant: deltas concatenate to decode() ---------------------------------------------


@pytest.mark.parametrize("use_decode_stream", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
def test_real_texts_token_by_token(tokenizer, use_decode_stream, chunk):
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        detok = IncrementalDetokenizer(tokenizer, use_decode_stream=use_decode_stream)
        deltas = stream(detok, ids, chunk=chunk)
        expected = decode(tokenizer, ids)
        assert "".join(deltas) == expected == detok.output_text
        assert detok.finished and detok.stop_reason is None
        assert detok.token_ids == ids
        # a well-formed text never streams half a character
        assert all("\ufffd" not in d for d in deltas)


def test_multibyte_characters_wait_for_their_last_byte(smol_tokenizer):
    ids = smol_tokenizer("😀", add_special_tokens=False).input_ids
    assert len(ids) > 1  # one emoji, several byte-level tokens
    detok = IncrementalDetokenizer(smol_tokenizer)
    deltas = stream(detok, ids, finish=False)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "😀"


@pytest.mark.parametrize("use_decode_stream", [True, False])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_ids_byte_level(smol_tokenizer, use_decode_stream, skip_special_tokens):
    # Any id sequence, special tokens and stray UTF-8 bytes included: byte-level BPE decodes
    # invalid bytes prefix-stably, so the invariant holds for all of them.
    rng = random.Random(1234)
    vocab = len(smol_tokenizer)
    for _ in range(40):
        # ids below 300 are mostly single bytes: bias towards them to split characters
        ids = [
            rng.randrange(300) if rng.random() < 0.5 else rng.randrange(vocab)
            for _ in range(rng.randrange(1, 40))
        ]
        detok = IncrementalDetokenizer(
            smol_tokenizer,
            skip_special_tokens=skip_special_tokens,
            use_decode_stream=use_decode_stream,
        )
        deltas = stream(detok, ids, chunk=rng.choice([1, 2, 5]))
        assert "".join(deltas) == decode(smol_tokenizer, ids, skip_special_tokens), ids


@pytest.mark.parametrize("use_decode_stream", [True, False])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_ids_byte_fallback(sp_tokenizer, use_decode_stream, skip_special_tokens):
    # Random pieces mixed with the byte tokens of whole characters. (Byte fallback turns a
    # whole run of bytes into U+FFFDs once it turns out invalid, so no incremental decoder
    # can match decode() on invalid byte runs; models emit valid ones.)
    rng = random.Random(99)
    pieces = [
        i
        for i in range(len(sp_tokenizer))
        if not sp_tokenizer.convert_ids_to_tokens(i).startswith("<0x")
    ]
    chars = list("世界😀é€ß한ñ")
    for _ in range(40):
        ids: list[int] = []
        while len(ids) < rng.randrange(1, 40):
            if rng.random() < 0.3:
                ids += sp_tokenizer(rng.choice(chars), add_special_tokens=False).input_ids[1:]
            else:
                ids.append(rng.choice(pieces))
        detok = IncrementalDetokenizer(
            sp_tokenizer,
            skip_special_tokens=skip_special_tokens,
            use_decode_stream=use_decode_stream,
        )
        deltas = stream(detok, ids, chunk=rng.choice([1, 2, 5]))
        assert "".join(deltas) == decode(sp_tokenizer, ids, skip_special_tokens), ids


def test_decode_stream_failure_falls_back_to_offsets(smol_tokenizer, monkeypatch):
    calls = {"n": 0}
    real_step = detok_mod._StreamDecoder.step

    def flaky_step(self, token_id):
        calls["n"] += 1
        if calls["n"] == 4:
            raise Exception("Invalid prefix encountered")
        return real_step(self, token_id)

    monkeypatch.setattr(detok_mod._StreamDecoder, "step", flaky_step)
    text = TEXTS[0] + " " + TEXTS[1]
    ids = smol_tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(smol_tokenizer)
    assert "".join(stream(detok, ids)) == text
    assert isinstance(detok._decoder, detok_mod._OffsetDecoder)


# -- special tokens and stop tokens ------------------------------------------------------------


def test_skip_special_tokens(smol_tokenizer):
    tok = smol_tokenizer
    body = tok("user\nHi there", add_special_tokens=False).input_ids
    ids = [1, *body, 2, 3]  # <|im_start|> ... <|im_end|> <repo_name>
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        text = "".join(stream(detok, ids))
        assert text == decode(tok, ids, skip)
    assert text == "<|im_start|>user\nHi there<|im_end|><repo_name>"
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    assert "".join(stream(detok, ids)) == "user\nHi there"


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_dropped_unless_included(smol_tokenizer, include):
    ids = [*smol_tokenizer("Bye now", add_special_tokens=False).input_ids, 2]
    detok = IncrementalDetokenizer(
        smol_tokenizer, skip_special_tokens=False, include_stop_str_in_output=include
    )
    text = "".join(stream(detok, ids, stop_token_terminated=True))
    assert text == ("Bye now<|im_end|>" if include else "Bye now")
    assert detok.token_ids == ids  # the stop token id is kept either way
    assert detok.decoded_token_ids == (ids if include else ids[:-1])
    assert detok.stop_reason is None  # a stop *token* is reported by the engine, not here


# -- stop strings ------------------------------------------------------------------------------

SENTENCE = "The capital of France is Paris. It is big."


def _stop_spans_tokens(tokenizer, ids: list[int], stop: str) -> bool:
    return not any(stop in tokenizer.decode([i]) for i in ids)


def test_stop_string_split_across_tokens_is_never_streamed(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok(SENTENCE, add_special_tokens=False).input_ids
    stop = "is Par"
    assert _stop_spans_tokens(tok, ids, stop)
    detok = IncrementalDetokenizer(tok, stop=[stop])
    streamed = ""
    for token_id in ids:
        streamed += detok.update([token_id])
        # what has been streamed is always a prefix of the final answer
        assert "The capital of France ".startswith(streamed)
        if detok.finished:
            break
    assert streamed == detok.output_text == "The capital of France "
    assert detok.stop_reason == stop
    # the token that completed the stop string is the last one accepted
    n = len(detok.token_ids)
    assert detok.token_ids == ids[:n] and n < len(ids)
    assert "Par" in decode(tok, ids[:n]) and "Par" not in decode(tok, ids[: n - 1])
    assert detok.update(ids[n:], finished=True) == ""
    assert detok.token_ids == ids[:n]


def test_stop_string_included_in_output(smol_tokenizer):
    ids = smol_tokenizer(SENTENCE, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(smol_tokenizer, stop=["is Par"], include_stop_str_in_output=True)
    assert "".join(stream(detok, ids, finish=False)) == "The capital of France is Par"
    assert detok.stop_reason == "is Par"


@pytest.mark.parametrize("chunk", [1, 100])
def test_first_of_several_stop_strings_wins(smol_tokenizer, chunk):
    ids = smol_tokenizer(SENTENCE, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(smol_tokenizer, stop=["Paris", "France is", "capital"])
    assert "".join(stream(detok, ids, chunk=chunk, finish=False)) == "The "
    assert detok.stop_reason == "capital"


def test_earliest_ending_stop_string_wins_within_one_update(smol_tokenizer):
    # "capital of" starts first but "cap" ends first: reading left to right, "cap" is seen
    # first, exactly as if the tokens had arrived one by one.
    ids = smol_tokenizer(SENTENCE, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(smol_tokenizer, stop=["capital of", "pit"])
    assert "".join(stream(detok, ids, chunk=len(ids), finish=False)) == "The ca"
    assert detok.stop_reason == "pit"


def test_held_back_text_is_released_on_finish(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok(SENTENCE, add_special_tokens=False).input_ids
    stop = "NEVER SEEN"
    detok = IncrementalDetokenizer(tok, stop=[stop])
    streamed = ""
    for token_id in ids:
        streamed += detok.update([token_id])
        held = len(detok.output_text) - len(streamed)
        assert held == min(len(stop) - 1, len(detok.output_text))
        assert detok.streamed_text == streamed
    streamed += detok.update([], finished=True)
    assert streamed == SENTENCE and detok.stop_reason is None


def test_stop_string_made_of_byte_tokens(sp_tokenizer):
    text = "Hello 世界 world"
    ids = sp_tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(sp_tokenizer, stop=["界"])
    assert "".join(stream(detok, ids, finish=False)) == "Hello 世"
    assert detok.stop_reason == "界"


def test_min_tokens_delays_stop_strings(smol_tokenizer):
    ids = smol_tokenizer("Hello world. Hello again", add_special_tokens=False).input_ids
    assert smol_tokenizer.decode(ids[:1]) == "Hello"
    detok = IncrementalDetokenizer(smol_tokenizer, stop=["Hello"], min_tokens=1)
    assert "".join(stream(detok, ids, finish=False)) == "Hello world. "
    assert detok.stop_reason == "Hello"


def test_from_sampling_params(smol_tokenizer):
    params = SamplingParams(stop=["France"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer.from_sampling_params(smol_tokenizer, params)
    ids = smol_tokenizer(SENTENCE, add_special_tokens=False).input_ids
    assert "".join(stream(detok, ids)) == "The capital of France"


def test_empty_stop_string_is_rejected(smol_tokenizer):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(smol_tokenizer, stop=[""])


# -- decode once at the end (the offline LLM's outputs) -----------------------------------------


@pytest.mark.parametrize("include_stop", [False, True])
def test_decode_at_finish_gives_the_per_token_text(tokenizer, include_stop):
    for text in TEXTS:
        ids = [*tokenizer(text, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
        per_token = IncrementalDetokenizer(tokenizer, include_stop_str_in_output=include_stop)
        at_end = IncrementalDetokenizer(
            tokenizer, include_stop_str_in_output=include_stop, decode_at_finish=True
        )
        deltas = stream(at_end, ids, stop_token_terminated=True)
        assert deltas[:-1] == [""] * (len(ids) - 1)  # nothing decoded before the end
        expected = "".join(stream(per_token, ids, stop_token_terminated=True))
        assert deltas[-1] == expected == at_end.output_text == at_end.streamed_text
        assert at_end.token_ids == ids and at_end.finished


def test_decode_at_finish_is_chosen_only_without_stop_strings(smol_tokenizer):
    ids = smol_tokenizer(SENTENCE, add_special_tokens=False).input_ids
    plain = IncrementalDetokenizer.from_sampling_params(
        smol_tokenizer, SamplingParams(), read_at_finish_only=True
    )
    assert plain.update(ids) == ""  # deferred
    with_stop = IncrementalDetokenizer.from_sampling_params(
        smol_tokenizer, SamplingParams(stop=["France"]), read_at_finish_only=True
    )
    assert "".join(stream(with_stop, ids)) == "The capital of "
    with pytest.raises(ValueError, match="stop strings need per-token decoding"):
        IncrementalDetokenizer(smol_tokenizer, stop=["x"], decode_at_finish=True)


# -- a byte-level tokenizer written with a sentencepiece decoder in front (transformers 5.17) --

#: The decoder transformers 5.17 writes for a GGUF file's GPT-2 style tokenizer (SmolLM2's).
SENTENCEPIECE_THEN_BYTE_LEVEL = {
    "type": "Sequence",
    "decoders": [
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    ],
}


@pytest.fixture
def smol_dir_with_5_17_decoder(smol_tokenizer_dir, tmp_path):
    """SmolLM2's tokenizer files with the decoder transformers 5.17's GGUF conversion gives
    them (written here, so the test does not depend on the installed version)."""
    import json
    import shutil

    for path in smol_tokenizer_dir.iterdir():
        shutil.copy(path, tmp_path / path.name)
    state = json.loads((tmp_path / "tokenizer.json").read_text())
    state["decoder"] = SENTENCEPIECE_THEN_BYTE_LEVEL
    (tmp_path / "tokenizer.json").write_text(json.dumps(state))
    return tmp_path


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_added_token_text_does_not_depend_on_the_converting_version(
    smol_dir_with_5_17_decoder, use_decode_stream
):
    """Behind ``Fuse``, ``ByteLevel`` sees one string; an added token holding a space makes it
    return that whole string untranslated (``"ĠHello"``). ``load_tokenizer`` gives such a
    tokenizer the plain ``ByteLevel`` decoder, so the streamed text is the tokens' text."""
    from transformers import AutoTokenizer

    from chassis.core.tokenizer import load_tokenizer

    text = " Hello world,\n\tnaïve 中文 <0x41> ▁x"
    as_written = AutoTokenizer.from_pretrained(smol_dir_with_5_17_decoder)
    as_written.add_tokens(["abc def"])
    ids = [as_written.convert_tokens_to_ids("abc def")]
    ids += as_written.encode(text, add_special_tokens=False)
    assert decode(as_written, ids, False) != "abc def" + text  # the decoder as written is wrong

    tokenizer = load_tokenizer(smol_dir_with_5_17_decoder)
    tokenizer.add_tokens(["abc def"])
    assert decode(tokenizer, ids, False) == "abc def" + text
    detok = IncrementalDetokenizer(
        tokenizer, skip_special_tokens=False, use_decode_stream=use_decode_stream
    )
    deltas = stream(detok, ids)
    assert "".join(deltas) == detok.output_text == "abc def" + text


def test_decoder_repair_leaves_other_tokenizers_alone(smol_tokenizer, sp_tokenizer):
    import copy

    from chassis.core.tokenizer import repair_byte_level_decoder

    for tokenizer in (smol_tokenizer, sp_tokenizer):
        tokenizer = copy.deepcopy(tokenizer)
        before = tokenizer.backend_tokenizer.decoder.__getstate__()
        repair_byte_level_decoder(tokenizer)
        assert tokenizer.backend_tokenizer.decoder.__getstate__() == before


def test_decoder_repair_leaves_a_sentencepiece_bpe_with_byte_fallback_alone():
    """Llama/Mistral-style BPE (sentencepiece as BPE: ``▁`` words, ``<0xNN>`` byte tokens)
    keeps its ``Replace, ByteFallback, Fuse, Strip`` decoder: it has no ``ByteLevel`` step or
    pre-tokenizer, so it is not the shape the repair replaces, and decodes byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from chassis.core.tokenizer import repair_byte_level_decoder

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "▁Hi": 258}
    steps = [
        decoders.Replace("▁", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ]
    for pre in (pre_tokenizers.Metaspace(), None):
        backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
        backend.pre_tokenizer = pre
        backend.decoder = decoders.Sequence(steps)
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
        before = backend.decoder.__getstate__()
        assert repair_byte_level_decoder(tokenizer) is False
        assert tokenizer.backend_tokenizer.decoder.__getstate__() == before
        ids = [258, *(1 + b for b in " é".encode())]
        assert tokenizer.decode(ids) == "Hi é"
