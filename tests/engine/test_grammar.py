"""Constrained decoding with a real byte-level BPE tokenizer (trained here) and random logits."""

import json
import random
import zlib

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.grammar import GrammarBackend, is_terminated, tokenizer_info_from_json
from engine.grammar_check import check_json_schema
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

EOS = "<|endoftext|>"
MAX_STEPS = 200


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    rng = random.Random(0)
    words = ["alpha", "beta", "red", "green", "blue", "name", "tags", "count", "ok", "true", "false", "null"]
    texts = []
    for _ in range(300):
        doc = {rng.choice(words): rng.choice([rng.choice(words), rng.randint(-999, 999), [1.5, "x y"], None])}
        texts.append(json.dumps(doc) + " " + json.dumps(doc, separators=(",", ":")))
    texts.append('\\n\\t\\" \\u00e9 { } [ ] : , 0123456789 -+.eE')
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS, "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_path):
    return Tokenizer.from_file(str(tokenizer_path))


@pytest.fixture(scope="module")
def backend(tokenizer_path, tokenizer):
    # The model's vocabulary is padded beyond the tokenizer's, as real checkpoints often are.
    return GrammarBackend.from_tokenizer_json(tokenizer_path, tokenizer.get_vocab_size() + 13, [0])


def generate(backend, tokenizer, params_list, seed=0, max_steps=MAX_STEPS):
    """Drive the sampler with random logits until every sequence's grammar terminates (or max_steps)."""
    vocab = backend.vocab_size
    sampler = Sampler(vocab, backend, seed=seed)
    seqs = [Sequence(f"r{i}", [1, 2, 3], p, index=i) for i, p in enumerate(params_list)]
    gen = torch.Generator().manual_seed(seed)
    live = list(seqs)
    for _ in range(max_steps):
        if not live:
            break
        logits = torch.randn(len(live), vocab, generator=gen) * 4
        for s, result in zip(live, sampler.sample(logits, live), strict=True):
            s.append_token(result.token_id)
            assert result.terminated == is_terminated(s)
        live = [s for s in live if not is_terminated(s)]
    texts = []
    for s in seqs:
        partial = tokenizer.decode(s.output_token_ids)
        assert is_terminated(s), f"no termination within {max_steps} steps: {partial!r}"
        assert s.output_token_ids[-1] == 0 and 0 not in s.output_token_ids[:-1]
        texts.append(tokenizer.decode(s.output_token_ids[:-1], skip_special_tokens=False))
    return texts


BOUNDED_SCHEMAS = [
    {"enum": ["red", "green", "blue"]},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "color": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "color", "ok", "count"],
    },
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {"location": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["location", "unit"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("schema", BOUNDED_SCHEMAS)
def test_bounded_schema_outputs_terminate_and_validate(backend, tokenizer, schema):
    params = [SamplingParams(json_schema=schema, temperature=1.0, max_tokens=MAX_STEPS) for _ in range(6)]
    seed = zlib.crc32(json.dumps(schema).encode()) % 1000  # stable across processes, unlike hash()
    for text in generate(backend, tokenizer, params, seed=seed):
        value = json.loads(text)
        jsonschema.validate(value, schema)


def test_compact_output_has_no_free_whitespace(backend, tokenizer):
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 2]}, "b": {"type": "boolean"}},
        "required": ["a", "b"],
    }
    for text in generate(backend, tokenizer, [SamplingParams(json_schema=schema) for _ in range(4)], seed=3):
        assert text == json.dumps(json.loads(text), separators=(",", ":"))


def test_json_object_mode_outputs_objects(backend, tokenizer):
    params = SamplingParams(json_object=True, temperature=1.0)
    vocab = backend.vocab_size
    sampler = Sampler(vocab, backend)
    gen = torch.Generator().manual_seed(1)
    finished = 0
    for i in range(6):
        s = Sequence(f"o{i}", [1], params)
        for _ in range(120):
            logits = torch.randn(1, vocab, generator=gen) * 4
            logits[0, 0] += 6.0  # favour EOS so that documents close quickly once they may
            s.append_token(sampler.sample(logits, [s])[0].token_id)
            if is_terminated(s):
                break
        if is_terminated(s):
            finished += 1
            text = tokenizer.decode(s.output_token_ids[:-1], skip_special_tokens=False)
            assert isinstance(json.loads(text), dict)
    assert finished >= 1


def test_greedy_and_mixed_batch(backend, tokenizer):
    schema = {"enum": ["alpha", "beta"]}
    plain = Sequence("p", [1, 2], SamplingParams(temperature=0.0))
    constrained = Sequence("c", [1, 2], SamplingParams(json_schema=schema, temperature=0.0))
    sampler = Sampler(backend.vocab_size, backend)
    logits = torch.randn(2, backend.vocab_size, generator=torch.Generator().manual_seed(0))
    results = sampler.sample(logits, [plain, constrained])
    assert results[0].token_id == int(logits[0].argmax())
    assert constrained.sampler_state is not None and plain.sampler_state is None
    first = tokenizer.decode([results[1].token_id])
    assert '"alpha"'.startswith(first) or '"beta"'.startswith(first)


def test_special_tokens_only_as_stop(backend, tokenizer_path, tokenizer):
    info = tokenizer_info_from_json(tokenizer_path, tokenizer.get_vocab_size(), [0])
    assert 1 in info.special_token_ids  # <|im_start|> never appears inside JSON
    assert info.stop_token_ids == [0]


def test_invalid_schema_and_regex_raise_value_error(backend):
    with pytest.raises(ValueError, match="json_schema"):
        SamplingParams(json_schema={"type": "no-such-type"})
    with pytest.raises(ValueError, match="json_schema"):
        check_json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})
    with pytest.raises(ValueError, match="regex"):
        SamplingParams(regex="(unclosed")
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(json_object=True, json_schema={"type": "object"})


def test_grammar_cache_is_canonical_and_bounded(tokenizer_path, tokenizer):
    small = GrammarBackend.from_tokenizer_json(tokenizer_path, tokenizer.get_vocab_size(), [0])
    small._max_cached = 2
    a = small.compile(
        SamplingParams(json_schema={"type": "object", "properties": {"x": {"type": "integer"}}})
    )
    b = small.compile(
        SamplingParams(json_schema={"properties": {"x": {"type": "integer"}}, "type": "object"})
    )
    assert a is b
    small.compile(SamplingParams(json_object=True))
    small.compile(SamplingParams(regex="[ab]+"))
    assert len(small._cache) == 2
    assert small.compile(SamplingParams()) is None


def test_regex_constrained(backend, tokenizer):
    params = [SamplingParams(regex="(yes|no)-[0-9]{2}") for _ in range(4)]
    for text in generate(backend, tokenizer, params, seed=5):
        assert text[:-3] in ("yes", "no") and text[-3] == "-" and text[-2:].isdigit()


def _allowed(bitmask_row, token_id):
    return bool((int(bitmask_row[token_id // 32]) >> (token_id % 32)) & 1)


def test_json_strings_never_get_control_chars_or_surrogates(backend):
    """xgrammar's bounded-string rule admits raw control characters and UTF-8-encoded surrogates."""
    vocab = backend.tokenizer_info.decoded_vocab
    byte_token = {t[0]: i for i, t in enumerate(vocab) if len(t) == 1}
    s = Sequence("s", [1], SamplingParams(json_schema={"type": "string", "maxLength": 5}))
    state = backend.state_for(s)
    assert backend.accept(state, byte_token[ord('"')])
    bitmask, _ = backend.fill_bitmask([state])
    assert not _allowed(bitmask[0], byte_token[0x11]) and not _allowed(bitmask[0], byte_token[ord("\n")])
    assert _allowed(bitmask[0], byte_token[ord("a")]) and _allowed(bitmask[0], byte_token[0xED])
    assert backend.accept(state, byte_token[0xED])
    bitmask, _ = backend.fill_bitmask([state])
    assert not _allowed(bitmask[0], byte_token[0xA7])  # ED A7 would encode a surrogate
    assert _allowed(bitmask[0], byte_token[0x9F])  # ED 9F BF is U+D7FF, valid


def _mask_after(backend, params, prefix):
    """The bitmask row of a fresh matcher that accepted ``prefix`` (no drafts involved)."""
    state = backend.state_for(Sequence("fresh", [1], params))
    for token_id in prefix:
        assert backend.accept(state, token_id)
    return backend.fill_bitmask([state])[0][0]


def test_draft_rows_are_masked_with_the_state_after_the_drafts_before_them(backend, tokenizer):
    """Speculative decoding: row j of a drafted sequence sees the grammar after drafts 0..j-1; past a
    draft the grammar forbids, or one that completes the document, the rows copy its row; the matcher is
    rolled back to the sequence's known output."""
    params = SamplingParams(json_schema=BOUNDED_SCHEMAS[1])
    ids = tokenizer.encode('{"name":"ab","color":"red","ok":true,"count":12}').ids
    seq = Sequence("s", [1], params)
    state = backend.state_for(seq)
    for token_id in ids[:3]:  # {"name":"
        assert backend.accept(state, token_id)
    before = backend.fill_bitmask([state])[0][0].clone()
    other = backend.state_for(Sequence("o", [1], params))
    # A free row, the drafted sequence's 5 rows, another constrained row.
    bitmask, rows = backend.fill_bitmask([None] + [state] * 5 + [other], {1: ids[3:7]})
    assert rows == [1, 2, 3, 4, 5, 6]
    for j in range(5):
        assert torch.equal(bitmask[1 + j], _mask_after(backend, params, ids[:3 + j]))
    assert torch.equal(bitmask[6], _mask_after(backend, params, []))
    assert torch.equal(backend.fill_bitmask([state])[0][0], before) and not state.after_ed

    # '12' where a property name starts: not in the (strict) schema. Its row forbids it; later rows copy.
    wrong = [ids[3], ids[4], ids[5], ids[6], tokenizer.token_to_id("12"), ids[7]]
    bitmask, _ = backend.fill_bitmask([state] * 7, {0: wrong})
    for j in range(5):
        assert torch.equal(bitmask[j], _mask_after(backend, params, ids[:3 + j]))
    assert not _allowed(bitmask[4], wrong[4])
    assert torch.equal(bitmask[5], bitmask[4]) and torch.equal(bitmask[6], bitmask[4])
    assert torch.equal(backend.fill_bitmask([state])[0][0], before)

    # Drafts through the end of the document and its stop token: rolled back from the terminated state.
    for token_id in ids[3:-1]:
        assert backend.accept(state, token_id)
    bitmask, _ = backend.fill_bitmask([state] * 4, {0: [ids[-1], 0, ids[0]]})
    assert _allowed(bitmask[1], 0) and not _allowed(bitmask[1], ids[0])  # only the stop token
    assert torch.equal(bitmask[1], _mask_after(backend, params, ids))
    assert torch.equal(bitmask[2], bitmask[1]) and torch.equal(bitmask[3], bitmask[1])
    assert not state.matcher.is_terminated()
    assert torch.equal(backend.fill_bitmask([state])[0][0], _mask_after(backend, params, ids[:-1]))


def test_draft_rows_get_the_json_byte_masks_of_their_own_position(backend):
    """The control-character and surrogate masks apply per draft row, and a draft only they forbid
    stops the walk like one the grammar forbids."""
    vocab = backend.tokenizer_info.decoded_vocab
    byte_token = {t[0]: i for i, t in enumerate(vocab) if len(t) == 1}
    state = backend.state_for(Sequence("s", [1], SamplingParams(json_schema={"type": "string",
                                                                             "maxLength": 5})))
    assert backend.accept(state, byte_token[ord('"')])
    bitmask, _ = backend.fill_bitmask([state] * 3, {0: [byte_token[0xED], byte_token[0x9F]]})
    assert torch.equal(bitmask[0], backend.fill_bitmask([state])[0][0])
    assert not _allowed(bitmask[1], byte_token[0xA7]) and _allowed(bitmask[1], byte_token[0x9F])
    assert not state.after_ed
    bitmask, _ = backend.fill_bitmask([state] * 3, {0: [byte_token[0x11], byte_token[ord("a")]]})
    assert not _allowed(bitmask[0], byte_token[0x11])
    assert torch.equal(bitmask[1], bitmask[0]) and torch.equal(bitmask[2], bitmask[0])


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"decoder": {"type": "ByteLevel"}}, ("BYTE_LEVEL", False)),
        (  # Llama-2 / Mistral style sentencepiece BPE
            {
                "normalizer": {
                    "type": "Sequence",
                    "normalizers": [{"type": "Prepend", "prepend": "▁"}, {"type": "Replace"}],
                },
                "decoder": {
                    "type": "Sequence",
                    "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}, {"type": "Fuse"}],
                },
            },
            ("BYTE_FALLBACK", True),
        ),
        (
            {
                "pre_tokenizer": {"type": "Metaspace", "prepend_scheme": "never"},
                "decoder": {"type": "Metaspace"},
            },
            ("RAW", False),
        ),
    ],
)
def test_vocab_type_detection(spec, expected):
    from engine.grammar import _detect_vocab_type

    vocab_type, prefix_space = _detect_vocab_type(spec)
    assert (vocab_type.name, prefix_space) == expected
