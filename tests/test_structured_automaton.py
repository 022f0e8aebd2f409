"""The byte automaton, token masks, vocabulary conversion and the "chassis" structured-output
backend: automaton vs the test IR matcher, vectorized masks vs a per-token walk (synthetic
and SmolLM2 vocabularies), matcher rules, and tokenizer byte mappings vs real decoding."""

from __future__ import annotations

import importlib
import itertools
import json
import random
import time
from collections.abc import Callable
from typing import Optional

import numpy as np
import pydantic
import pytest
from ir_matcher import ir_fullmatch, ir_sample, spelled_out
from test_structured_regex import sample

from chassis.builtin_plugins.structured_output import automaton as automaton_module
from chassis.builtin_plugins.structured_output import (
    chassis_register_structured_output_backends,
    ir,
    json_schema,
    json_syntax,
)
from chassis.builtin_plugins.structured_output.automaton import DEAD, Automaton
from chassis.builtin_plugins.structured_output.backend import (
    ChassisStructuredOutputBackend,
    constraint_to_ir,
)
from chassis.builtin_plugins.structured_output.regex import regex_to_ir
from chassis.builtin_plugins.structured_output.token_masks import (
    TokenMasks,
    TokenTable,
    allowed_tokens,
)
from chassis.core.structured_output import StructuredOutputsParams, TokenVocabulary
from chassis.core.token_vocabulary import vocabulary_from_tokenizer

# -- random IR trees vs the IR matcher -------------------------------------------------------

LEAVES = [ir.Bytes(b"a"), ir.Bytes(b"bc"), ir.Bytes(b""), ir.byte_range(0x61, 0x63)]
LEAVES += [ir.ByteSet(frozenset()), ir.literal("é"), ir.ByteSet(frozenset(b"c\xc3"))]


def nullable(node: ir.Node) -> bool:
    if isinstance(node, ir.Bytes):
        return not node.value
    if isinstance(node, ir.ByteSet):
        return False
    if isinstance(node, ir.Seq):
        return all(nullable(item) for item in node.items)
    if isinstance(node, ir.Alt):
        return any(nullable(option) for option in node.options)
    if isinstance(node, ir.Separated):
        return all(nullable(item) for item, required in node.items if required)
    if node.min == 0:
        return True
    separator_nullable = node.separator is None or nullable(node.separator)
    return nullable(node.item) and (node.min == 1 or separator_nullable)


def random_ir(rng: random.Random, depth: int) -> ir.Node:
    if depth == 0 or rng.random() < 0.25:
        return rng.choice(LEAVES)
    kind = rng.choice(["seq", "alt", "repeat", "separated", "members"])
    if kind == "members":  # items in order, the optional ones may be left out
        count = rng.randint(0, 4)
        items = tuple((random_ir(rng, depth - 1), rng.random() < 0.4) for _ in range(count))
        return ir.Separated(items, rng.choice(LEAVES))
    if kind == "separated":  # a separated repetition (arrays, object members)
        item = random_ir(rng, depth - 1)
        separator = rng.choice(LEAVES) if rng.random() < 0.7 else random_ir(rng, depth - 1)
        low = rng.randint(0, 2)
        high = rng.choice([None, None, low, low + 1, low + 3])
        return ir.Repeat(item, low, high, separator)
    if kind == "seq":
        return ir.Seq(tuple(random_ir(rng, depth - 1) for _ in range(rng.randint(0, 3))))
    if kind == "alt":
        return ir.Alt(tuple(random_ir(rng, depth - 1) for _ in range(rng.randint(0, 3))))
    item = random_ir(rng, depth - 1)
    # the IR matcher stops early on nullable items repeated at least twice: keep min <= 1
    low = rng.randint(0, 1 if nullable(item) else 2)
    high = rng.choice([None, low, low + 1, low + 3])
    return ir.Repeat(item, low, high)


def can_complete(automaton: Automaton, state: int) -> bool:
    seen, frontier = {state}, [state]
    while frontier:
        s = frontier.pop()
        if automaton.is_accepting(s):
            return True
        for t in set(automaton.row(s).tolist()) - seen - {DEAD}:
            seen.add(t)
            frontier.append(t)
    return False


def test_automaton_matches_ir_matcher_on_random_trees() -> None:
    rng = random.Random(7)
    pieces = [b"a", b"b", b"c", b"bc", "é".encode(), b"\xc3", b"\xa9", b"x"]
    for _ in range(300):
        node = random_ir(rng, 4)
        automaton = Automaton.from_ir(node)
        for _ in range(25):
            data = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 5)))
            assert automaton.fullmatch(data) == ir_fullmatch(node, data), (node, data)
            state = automaton.walk(automaton.start, data)
            if state != DEAD:
                # trimmed: every live state can still complete
                assert can_complete(automaton, state), (node, data)
                row = automaton.row(state)
                assert automaton.is_terminal(state) == (
                    automaton.is_accepting(state) and bool((row == DEAD).all())
                )


def nfa_of(node: ir.Node, recursion_depth: int) -> tuple:
    """The states and edges :meth:`_Nfa.build` makes for ``node``, recursing at most
    ``recursion_depth`` levels (0: the iterative reference path only)."""
    nfa = automaton_module._Nfa()
    nfa.recursion_depth = recursion_depth
    exit_state = nfa.build(node, nfa.new())
    edges = (nfa.edge_from, nfa.edge_ranges, nfa.edge_to)
    return nfa.size, exit_state, nfa.eps_from, nfa.eps_to, *edges


def test_the_recursive_nfa_build_equals_the_iterative_one() -> None:
    """The build's fast path (recursion for the top levels) makes the same states and edges
    in the same order as its reference, the iterative path, on random trees, the JSON of
    ``json_object``, and a tree deeper than the recursion goes (whose frames stay few)."""
    rng = random.Random(11)
    nodes = [random_ir(rng, 5) for _ in range(200)]
    nodes.append(json_schema.any_json_object())
    deep: ir.Node = ir.Bytes(b"x")
    for i in range(3000):  # deeper than any recursion limit
        deep = ir.Seq(
            (ir.Bytes(b"("), ir.Alt((deep, ir.ByteSet(frozenset(b"ab")))), ir.Bytes(b")"))
        )
        deep = ir.Repeat(deep, 0, 1) if i % 2 else deep
    nodes.append(deep)
    for node in nodes:
        reference = nfa_of(node, 0)
        assert nfa_of(node, automaton_module.BUILD_RECURSION_DEPTH) == reference
        assert nfa_of(node, 3) == reference


def old_form(node: ir.Node, memo: dict[int, tuple[ir.Node, ir.Node]]) -> ir.Node:
    """``node`` as the automaton's construction before separated repetitions: a separated
    repetition spelled out as ``item (separator item)*``, an unbounded ``x{m,}``
    (``m >= 1``) as ``x{m} x*``, each of which copies ``x`` once more, and ``Separated``
    items as the alternatives of :func:`old_separated`."""
    known = memo.get(id(node))
    if known is not None:
        return known[1]
    out: ir.Node = node
    if isinstance(node, ir.Seq):
        out = ir.Seq(tuple(old_form(item, memo) for item in node.items))
    elif isinstance(node, ir.Alt):
        out = ir.Alt(tuple(old_form(option, memo) for option in node.options))
    elif isinstance(node, ir.Repeat) and node.separator is not None:
        out = old_form(spelled_out(node), memo)
    elif isinstance(node, ir.Separated):
        separator = old_form(node.separator, memo)
        parts = [
            old_forms(old_form(item, memo), required, separator) for item, required in node.items
        ]
        first, _, none = old_separated(parts) if parts else (ir.EMPTY, ir.EMPTY, ir.EMPTY)
        out = ir.alt(first, none)
    elif isinstance(node, ir.Repeat):
        item = old_form(node.item, memo)
        out = ir.Repeat(item, node.min, node.max)
        if node.max is None and node.min >= 1:
            out = ir.Seq((ir.Repeat(item, node.min, node.min), ir.Repeat(item, 0, None)))
    memo[id(node)] = (node, out)  # (the node too: an id is unique while its node lives)
    return out


_Forms = tuple[ir.Node, ir.Node, ir.Node]
NOTHING = ir.ByteSet(frozenset())


def old_forms(item: ir.Node, required: bool, separator: ir.Node) -> _Forms:
    """One item's three forms: written first (no separator), written later (after its
    separator), not written (the empty string, or nothing at all if it is required)."""
    later = ir.seq(separator, item)
    return (item, later, NOTHING) if required else (item, ir.optional(later), ir.EMPTY)


def old_separated(parts: list[_Forms]) -> _Forms:
    """The three forms of a run of items, from its halves' (the regular expression a JSON
    object's members were, O(n log n) items but every optional one copied per level):
    first(LR) = first(L) later(R) | none(L) first(R), later(LR) = later(L) later(R)."""
    if len(parts) == 1:
        return parts[0]
    first_l, later_l, none_l = old_separated(parts[: len(parts) // 2])
    first_r, later_r, none_r = old_separated(parts[len(parts) // 2 :])
    first = ir.alt(ir.seq(first_l, later_r), ir.seq(none_l, first_r))
    return first, ir.seq(later_l, later_r), ir.seq(none_l, none_r)


def model_chain(depth: int, wrap: Callable[[type], object], default: object = ...) -> dict:
    """The JSON schema pydantic writes for ``depth`` models, each with a ``name`` and (but
    the first) a ``child`` field of type ``wrap(previous model)`` (``list[M]``,
    ``Optional[M]``); both fields have ``default`` (``...``: none, they are required)."""
    name_default = "n" if default is not ... else ...
    model = pydantic.create_model("M0", name=(str, name_default))
    for d in range(1, depth):
        model = pydantic.create_model(
            f"M{d}", name=(str, name_default), child=(wrap(model), default)
        )
    return model.model_json_schema()


def test_separated_and_unbounded_repetitions_accept_what_they_did_spelled_out() -> None:
    """A separated repetition (one copy of its item, looping back through the separator)
    and ``x{m,}`` (``m - 1`` copies, then one looping) accept and refuse the same texts as
    the old construction (spelled out with more copies), on random trees and JSON schemas'
    arrays, free-form objects and ``json_object``."""
    rng = random.Random(5)
    nodes = [random_ir(rng, 4) for _ in range(300)]
    nodes += [
        json_schema.schema_to_ir(model_chain(3, lambda m: list[m])),
        json_schema.schema_to_ir(model_chain(3, lambda m: list[m], [])),
        json_schema.schema_to_ir(model_chain(3, lambda m: Optional[m], None)),  # noqa: UP045
        json_schema.schema_to_ir(
            {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}
        ),
        json_schema.schema_to_ir({"type": "array", "items": {"type": "boolean"}, "minItems": 3}),
        json_schema.schema_to_ir({"type": "object", "additionalProperties": {"type": "integer"}}),
        # (at a schema's free-form depth: json_object's, spelled out, is past the size limit)
        json_syntax.any_object(json_schema.ANY_JSON_DEPTH),
    ]
    pieces = [b"a", b"b", b"c", b"bc", "é".encode(), b"\xc3", b"x", b",", b"[", b"]", b" "]
    accepted = 0
    for node in nodes:
        new, old = Automaton.from_ir(node), Automaton.from_ir(old_form(node, {}))
        texts = [b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 6))) for _ in range(10)]
        for _ in range(10):
            try:
                text = ir_sample(node, rng)
            except IndexError:  # (the sample met a part that matches nothing)
                text = b""
            cut = rng.randint(0, len(text))
            texts += [text, text[:cut] + text[cut + 1 :], text[:cut] + b"," + text[cut:]]
        for text in texts:
            assert new.fullmatch(text) == old.fullmatch(text), (node, text)
            accepted += new.fullmatch(text)
    assert accepted > 1000  # (the samples do exercise acceptance)


@pytest.mark.parametrize("default", [..., []], ids=["required", "optional"])
def test_a_list_of_models_chain_grows_linearly_with_depth(default: object) -> None:
    """``list[Model]`` nested 12 deep compiles, and each level adds the same number of NFA
    states, whether the fields are required or optional (spelled out, an array copied its
    item twice, and so did optional members before the item's, so each level doubled the
    states and 10 levels passed the size limit)."""
    sizes = [
        Automaton.from_ir(json_schema.schema_to_ir(model_chain(d, lambda m: list[m], default)))
        for d in range(1, 13)
    ]
    steps = {b.nfa_size - a.nfa_size for a, b in itertools.pairwise(sizes)}
    assert len(steps) == 1, [a.nfa_size for a in sizes]
    instance: dict = {"name": "leaf"}
    for d in range(1, 12):
        instance = {
            "name": f"m{d}",
            "child": [instance, {"name": "x", "child": []}] if d > 1 else [instance],
        }
    text = json.dumps(instance)
    automaton = sizes[-1]
    assert automaton.fullmatch(text.encode())
    assert not automaton.fullmatch(text.replace('"leaf"', "7").encode())


def test_empty_language_and_size_limit() -> None:
    assert Automaton.from_ir(ir.ByteSet(frozenset())).matches_nothing
    assert Automaton.from_ir(ir.seq(ir.literal("a"), ir.Alt(()))).matches_nothing
    with pytest.raises(ValueError, match="constraint too large"):
        Automaton.from_ir(ir.Repeat(ir.Repeat(ir.literal("ab"), 0, 1000), 0, 1000))
    with pytest.raises(ValueError, match="constraint too large"):
        Automaton.from_ir(ir.Repeat(ir.literal("abc"), 0, 100), max_nfa_states=200)


def test_large_json_like_automaton() -> None:
    """Thousands of NFA states (bounded strings inside a bounded list) build quickly."""
    char = ir.alt(
        ir.unicode_char(excluded_ascii=[*range(32), 34, 92]),
        ir.seq(ir.literal("\\"), ir.ByteSet(frozenset(b'"\\/bfnrt'))),
    )
    string = ir.seq(ir.literal('"'), ir.Repeat(char, 0, 100), ir.literal('"'))
    member = ir.seq(string, ir.literal(":"), string)
    node = ir.seq(
        ir.literal("{"),
        ir.optional(ir.seq(member, ir.Repeat(ir.seq(ir.literal(","), member), 0, 19))),
        ir.literal("}"),
    )
    started = time.perf_counter()
    automaton = Automaton.from_ir(node)
    assert automaton.nfa_size > 10_000
    assert time.perf_counter() - started < 5
    text = "{" + ",".join(f'"k{i}":"v\\"é中😀{i}"' for i in range(20)) + "}"
    assert automaton.fullmatch(text.encode())
    assert not automaton.fullmatch(("{" + ",".join(['"a":"b"'] * 21) + "}").encode())
    assert not automaton.fullmatch(('{"a":"' + "x" * 101 + '"}').encode())


# -- token masks vs a per-token walk ---------------------------------------------------------


def brute_force_mask(automaton: Automaton, vocabulary: TokenVocabulary, state: int) -> np.ndarray:
    mask = np.zeros(vocabulary.vocab_size, dtype=bool)
    for token_id, token in enumerate(vocabulary.token_bytes):
        if token_id in vocabulary.eos_token_ids:
            mask[token_id] = state != DEAD and automaton.is_accepting(state)
        elif token:
            mask[token_id] = state != DEAD and automaton.walk(state, token) != DEAD
    return mask


def synthetic_vocabulary(rng: random.Random) -> TokenVocabulary:
    pieces = [b"a", b"b", b"1", b"2", b'"', b"{", b"}", b":", b",", b" ", b"\\", b"\n"]
    pieces += ["é".encode(), b"\xc3", b"\xa9", "中".encode()[:2], "中".encode()[2:]]
    tokens: list[bytes | None] = [None, None, b""]  # special, EOS, an empty token
    tokens += [bytes([b]) for b in range(256)]
    tokens += [b"".join(rng.choice(pieces) for _ in range(rng.randint(2, 9))) for _ in range(400)]
    tokens.append(b'"}')  # an EOS id that also has bytes: EOS rules apply, not its bytes
    return TokenVocabulary(tokens, eos_token_ids=frozenset({1, len(tokens) - 1}))


SYNTHETIC_PATTERNS = [
    r'\{"a": "([^"\\]|\\.)*", "b": \d{1,3}\}',
    r"(ab|1)*é?",
    r"[^\n]{0,6}",
    r"(yes|no|中文)",
]


@pytest.mark.parametrize("pattern", SYNTHETIC_PATTERNS)
def test_masks_match_brute_force_on_synthetic_vocabulary(pattern: str) -> None:
    rng = random.Random(pattern)
    vocabulary = synthetic_vocabulary(rng)
    tokens = TokenTable(vocabulary)
    automaton = Automaton.from_ir(regex_to_ir(pattern))
    node = regex_to_ir(pattern)
    states = {automaton.start, DEAD}
    for _ in range(30):  # states along random matching strings
        text = sample(node, rng)
        states.add(automaton.walk(automaton.start, text[: rng.randint(0, len(text))]))
        states.add(automaton.walk(automaton.start, text))
    for state in sorted(states):
        mask = allowed_tokens(automaton, tokens, state)
        np.testing.assert_array_equal(mask, brute_force_mask(automaton, vocabulary, state))
        assert not mask[0] and not mask[2]  # None and empty tokens
        assert mask[1] == mask[-1] == (state != DEAD and automaton.is_accepting(state))


def test_mask_cache_returns_shared_read_only_arrays() -> None:
    vocabulary = synthetic_vocabulary(random.Random(1))
    automaton = Automaton.from_ir(regex_to_ir(r"a+"))
    masks = TokenMasks(automaton, TokenTable(vocabulary))
    first = masks.allowed(automaton.start)
    assert masks.allowed(automaton.start) is first
    with pytest.raises(ValueError):
        first[0] = True


# -- the real SmolLM2 vocabulary ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_tokenizer_embedded():
    from chassis.core.gguf_checkpoint import embedded_model_dir
    from chassis.core.tokenizer import load_tokenizer

    return load_tokenizer(embedded_model_dir())


@pytest.fixture(scope="module")
def smol_vocabulary(smol_tokenizer_embedded) -> TokenVocabulary:
    tokenizer = smol_tokenizer_embedded
    return vocabulary_from_tokenizer(tokenizer, 49152, [tokenizer.eos_token_id])


def test_smollm2_vocabulary_decodes_like_the_tokenizer(smol_tokenizer_embedded, smol_vocabulary):
    tokenizer = smol_tokenizer_embedded
    token_bytes = smol_vocabulary.token_bytes
    assert len(token_bytes) == 49152
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special
    }
    assert all(token_bytes[i] is None for i in special)
    assert token_bytes[tokenizer.convert_tokens_to_ids("Ġthe")] == b" the"
    ids = [i for i, b in enumerate(token_bytes) if b is not None]
    assert len(ids) == 49152 - len(special)
    rng = random.Random(3)
    for _ in range(300):
        seq = rng.choices(ids, k=rng.randint(1, 12))
        expected = tokenizer.decode(seq, clean_up_tokenization_spaces=False)
        assert b"".join(token_bytes[i] for i in seq).decode("utf-8", "replace") == expected
    text = 'Hello, world! {"naïve": [1, 2.5e-3, "中文 😀"]}\n\tdef f(x):\n        return x  # ok'
    encoded = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes[i] for i in encoded) == text.encode("utf-8")


def test_smollm2_vocabulary_size_padding_and_added_tokens(smol_tokenizer_embedded):
    import copy

    tokenizer = copy.deepcopy(smol_tokenizer_embedded)  # the fixture stays unchanged
    tokenizer.add_tokens(["abc def", "Ġxyzq"])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<my_special>"]})
    plain, byte_level, special = tokenizer.convert_tokens_to_ids(
        ["abc def", "Ġxyzq", "<my_special>"]
    )
    vocabulary = vocabulary_from_tokenizer(tokenizer, 49160, [2])
    assert len(vocabulary.token_bytes) == 49160
    assert vocabulary.token_bytes[special] is None
    assert vocabulary.token_bytes[special + 1 :] == [None] * (49160 - special - 1)
    # an added token goes through the ByteLevel decoder too: "Ġxyzq" is " xyzq"
    assert vocabulary.token_bytes[plain] == b"abc def"
    assert vocabulary.token_bytes[byte_level] == b" xyzq"
    seq = [plain, 100, byte_level, 200]
    joined = b"".join(vocabulary.token_bytes[i] for i in seq).decode()
    assert joined == tokenizer.decode(seq, clean_up_tokenization_spaces=False)
    assert vocabulary.eos_token_ids == frozenset({2})
    assert vocabulary.tokenizer is tokenizer


def test_masks_match_brute_force_on_smollm2(smol_vocabulary) -> None:
    tokens = TokenTable(smol_vocabulary)
    pattern = r'\{"name": "([^"\\\x00-\x1f]|\\["\\/bfnrt])*", "age": (0|[1-9]\d{0,2})\}'
    automaton = Automaton.from_ir(regex_to_ir(pattern))
    in_string = automaton.walk(automaton.start, b'{"name": "B')
    in_number = automaton.walk(in_string, b'ob", "age": 4')
    for state in (automaton.start, in_string, in_number):
        mask = allowed_tokens(automaton, tokens, state)
        np.testing.assert_array_equal(mask, brute_force_mask(automaton, smol_vocabulary, state))
    final = automaton.walk(in_number, b"2}")
    mask = allowed_tokens(automaton, tokens, final)
    assert automaton.is_terminal(final) and np.flatnonzero(mask).tolist() == [2]


# -- SentencePiece-style tokenizers ------------------------------------------------------------


def metaspace_tokenizer():
    """A small BPE with a Metaspace pre-tokenizer and decoder and byte fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁he", "ll", "▁hell", "▁hello"]
    words += ["▁w", "or", "▁wor", "▁world", "é", "!"]
    vocab = {token: i for i, token in enumerate(pieces + words)}
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o")]
    merges += [("▁", "w"), ("o", "r"), ("▁w", "or"), ("▁wor", "l"), ("▁worl", "d")]
    vocab["▁worl"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def sentencepiece_tokenizers():
    from fixtures_tokenizer import make_sentencepiece_style_tokenizer

    return [metaspace_tokenizer(), make_sentencepiece_style_tokenizer()]


@pytest.mark.parametrize("which", [0, 1], ids=["metaspace_bpe", "replace_unigram"])
def test_sentencepiece_vocabulary_decodes_like_the_tokenizer(which: int) -> None:
    tokenizer = sentencepiece_tokenizers()[which]
    eos = tokenizer.eos_token_id
    vocabulary = vocabulary_from_tokenizer(tokenizer, len(tokenizer) + 3, [eos])
    token_bytes = vocabulary.token_bytes
    for name in ("<unk>", "<s>", "</s>"):
        assert token_bytes[tokenizer.convert_tokens_to_ids(name)] is None
    assert token_bytes[tokenizer.convert_tokens_to_ids("<0x0A>")] == b"\n"
    assert token_bytes[tokenizer.convert_tokens_to_ids("<0xE4>")] == b"\xe4"
    assert token_bytes[-3:] == [None] * 3
    words = [i for i, b in enumerate(token_bytes) if b and (len(b) > 1 or b < b"\x80")]
    byte_token = {b: tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    rng = random.Random(which)

    def decoded(seq: list[int]) -> str:
        text = b"".join(token_bytes[i] for i in seq).decode("utf-8")
        # the decoder drops one leading space at the start of the text: the Metaspace decoder
        # only a "▁" that starts the first token, Strip whatever space starts the text
        first = tokenizer.convert_ids_to_tokens(seq[0])
        if text.startswith(" ") and (which == 1 or first.startswith("▁")):
            return text[1:]
        return text

    for _ in range(300):
        seq: list[int] = []
        for _ in range(rng.randint(1, 10)):
            if rng.random() < 0.8:
                seq.append(rng.choice(words))
            else:  # a whole character as byte-fallback tokens
                seq += [byte_token[b] for b in rng.choice("中é😀\n ").encode()]
        assert decoded(seq) == tokenizer.decode(seq, clean_up_tokenization_spaces=False)
    text = "hello world! 中文 é\nhello"
    encoded = tokenizer.encode(text, add_special_tokens=False)
    assert decoded(encoded) == text


def test_unknown_tokenizer_kind_is_refused() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    with pytest.raises(ValueError, match="cannot tell how this tokenizer"):
        vocabulary_from_tokenizer(tokenizer, 2, [])
    with pytest.raises(ValueError, match="fast"):
        vocabulary_from_tokenizer(object(), 2, [])


# -- matcher and backend -----------------------------------------------------------------------

TINY = [None, b"y", b"es", b"yes", b"n", b"o", b"no", b"x", b"nox"]  # id 0: EOS
TINY_EOS = 0


@pytest.fixture
def tiny_backend() -> ChassisStructuredOutputBackend:
    return ChassisStructuredOutputBackend(TokenVocabulary(TINY, frozenset({TINY_EOS})))


def allowed_ids(matcher) -> list[int]:
    return np.flatnonzero(matcher.allowed_tokens()).tolist()


def test_matcher_accepts_rejects_and_terminates(tiny_backend) -> None:
    grammar = tiny_backend.compile(StructuredOutputsParams(choice=["yes", "no", "nox"]))
    matcher = grammar.matcher()
    assert allowed_ids(matcher) == [1, 3, 4, 6, 8]
    assert not matcher.accept_token(TINY_EOS)  # not complete yet
    assert not matcher.accept_token(7)  # "x": not allowed, nothing changes
    assert not matcher.accept_token(99) and not matcher.is_terminated()
    assert matcher.accept_token(4)  # "n"
    assert allowed_ids(matcher) == [5]  # "o" ("nno" and "ox" are not options)
    assert matcher.accept_token(5)  # "no": complete, but "x" may follow
    assert allowed_ids(matcher) == [TINY_EOS, 7]
    assert not matcher.is_terminated()
    assert matcher.accept_token(TINY_EOS)  # accepted, nothing changes
    assert allowed_ids(matcher) == [TINY_EOS, 7]
    assert matcher.accept_token(7)  # "nox"
    assert matcher.is_terminated() and allowed_ids(matcher) == [TINY_EOS]
    assert not matcher.accept_token(1)
    assert matcher.accept_token(TINY_EOS)
    other = grammar.matcher()  # matchers are independent
    assert other.accept_token(3) and other.is_terminated()


def test_backend_check_compile_and_cache(tiny_backend) -> None:
    regex = StructuredOutputsParams(regex=r"(yes|no)+")
    ChassisStructuredOutputBackend.check(regex)
    ChassisStructuredOutputBackend.check(regex)  # remembered
    grammar = tiny_backend.compile(regex)
    assert tiny_backend.compile(StructuredOutputsParams(regex=r"(yes|no)+")) is grammar
    matcher = grammar.matcher()
    for token in (3, 4, 5, 1, 2):
        assert matcher.accept_token(token)
    assert not matcher.is_terminated() and allowed_ids(matcher)[0] == TINY_EOS
    choice = StructuredOutputsParams(choice=["a", "b"])
    assert ir_fullmatch(constraint_to_ir(choice), "b")
    for bad, message in [
        (StructuredOutputsParams(regex=r"(a)\1"), "backreference"),
        (StructuredOutputsParams(regex=r"[^\x00-\U0010ffff]"), "matches no output"),
        (StructuredOutputsParams(regex=r"(a{1000}){1000}"), "too large"),
    ]:
        with pytest.raises(ValueError, match=message):
            ChassisStructuredOutputBackend.check(bad)
        with pytest.raises(ValueError, match=message):
            tiny_backend.compile(bad)


def test_backend_grammar_cache_is_bounded() -> None:
    backend = ChassisStructuredOutputBackend(TokenVocabulary(TINY, frozenset({0})), cache_size=2)
    first = backend.compile(StructuredOutputsParams(regex="y"))
    backend.compile(StructuredOutputsParams(regex="n"))
    backend.compile(StructuredOutputsParams(regex="x"))
    assert backend.compile(StructuredOutputsParams(regex="y")) is not first


def test_registration_hook() -> None:
    registered = {}

    class Registry:
        def register(self, name, target):
            registered[name] = target

    chassis_register_structured_output_backends(Registry())
    module, _, attr = registered["chassis"].partition(":")
    assert getattr(importlib.import_module(module), attr) is ChassisStructuredOutputBackend
    assert ChassisStructuredOutputBackend.name == "chassis"


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(
            json={
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer"},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                },
                "required": ["name", "age", "tags"],
            }
        ),
    ],
    ids=["json_object", "json_schema"],
)
def test_greedy_walk_produces_json(params, smol_vocabulary, smol_tokenizer_embedded) -> None:
    """A greedy walk ends in a complete JSON value: at each step EOS if allowed, else the
    first allowed of a few closing/short tokens, else the first allowed token. (Plain
    "first allowed token" would never leave a free string: "!" is a low id.)"""
    backend = ChassisStructuredOutputBackend(smol_vocabulary)
    ChassisStructuredOutputBackend.check(params)
    matcher = backend.compile(params).matcher()
    eos = next(iter(smol_vocabulary.eos_token_ids))
    preferred = [eos, *smol_tokenizer_embedded.convert_tokens_to_ids(list('}]"0:,a'))]
    out = b""
    for _ in range(400):
        allowed = matcher.allowed_tokens()
        token = next((t for t in preferred if allowed[t]), None)
        if token is None:
            token = int(np.flatnonzero(allowed)[0])
        assert matcher.accept_token(token)
        if token == eos:
            break
        out += smol_vocabulary.token_bytes[token]
    else:
        pytest.fail(f"no EOS after 400 tokens: {out[:200]!r}")
    assert matcher.is_terminated() or matcher.allowed_tokens()[eos]
    value = json.loads(out)
    assert isinstance(value, dict)


def test_json_kinds_dispatch_to_the_json_schema_module(monkeypatch, tiny_backend) -> None:
    """The wiring only, with a stand-in module: ``json`` passes the parsed schema (and its
    wrapper's levels) to ``schema_to_ir``, ``json_object`` calls ``any_json_object`` (the
    real module is tested by its own tests and by the greedy walk above)."""
    import sys
    import types

    from chassis.builtin_plugins import structured_output

    calls = []
    stand_in = types.ModuleType("json_schema")
    stand_in.schema_to_ir = lambda schema, wrapper_levels: (
        calls.append((schema, wrapper_levels)) or ir.literal("yes")
    )
    stand_in.any_json_object = lambda: ir.literal("no")
    name = "chassis.builtin_plugins.structured_output.json_schema"
    monkeypatch.setitem(sys.modules, name, stand_in)
    monkeypatch.setattr(structured_output, "json_schema", stand_in, raising=False)
    schema = {"type": "string", "enum": ["yes"]}
    matcher = tiny_backend.compile(StructuredOutputsParams(json=schema)).matcher()
    assert calls == [(schema, 0)]
    assert matcher.accept_token(3) and matcher.is_terminated()
    matcher = tiny_backend.compile(StructuredOutputsParams(json_object=True)).matcher()
    assert matcher.accept_token(6) and matcher.is_terminated()
