"""engine.tokenizer: encode/decode, chat templates (same text as transformers), incremental detokenizing
with multi-byte characters, and stop strings that span tokens."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

transformers = pytest.importorskip("transformers")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "rainy"},
    {"role": "assistant", "content": "Sunny in Paris, rainy in Nice."},
    {"role": "user", "content": "Thanks! 🙂"},
]


@pytest.fixture(scope="module")
def tok(tiny_qwen2_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_qwen2_dir)


def test_module_imports_no_torch() -> None:
    code = "import engine.tokenizer, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_encode_decode_matches_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    d = request.getfixturevalue(f"tiny_{arch}_dir")
    tok = Tokenizer.from_pretrained(d)
    hf = transformers.AutoTokenizer.from_pretrained(d)
    text = "def f(x):\n    return x * 2  # ça marche, 你好 🚀\n\n  The END. e\u0301"
    ids = tok.encode(text)
    assert ids == hf(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert tok.vocab_size == len(hf)
    assert tok.eos_token_ids == (
        hf.convert_tokens_to_ids("<|im_end|>"),
        hf.convert_tokens_to_ids("<|endoftext|>"),
    )
    assert tok.bos_token_id == (hf.bos_token_id if arch == "llama" else None)


def test_llama_bos(tiny_llama_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(tiny_llama_dir)
    bos = tok.token_to_id("<|begin_of_text|>")
    assert tok.bos_token_id == bos
    assert tok.encode("hi")[0] == bos
    assert tok.encode("hi", add_special_tokens=False)[0] != bos
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == bos and ids.count(bos) == 1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chat_template_matches_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    d = request.getfixturevalue(f"tiny_{arch}_dir")
    tok = Tokenizer.from_pretrained(d)
    hf = transformers.AutoTokenizer.from_pretrained(d)
    # transformers takes the template's shapes as they are: give it what the OpenAI shapes mean.
    hf_messages = [dict(m) for m in TOOL_CONVERSATION]
    hf_messages[1] = {"role": "user", "content": "Weather in\nParis?"}
    for gen in (True, False):
        ours = tok.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, add_generation_prompt=gen)
        theirs = hf.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=gen)
        assert ours == theirs
    assert '{"name": "get_weather", "arguments": {"city": "Nice"}}' in ours
    assert ours.count("<tool_response>") == 2 and ours.count("<|im_start|>user") == 3
    plain = [{"role": "user", "content": "Hello"}]
    assert tok.apply_chat_template(plain) == hf.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=True
    )
    assert tok.encode_chat(plain) == hf.apply_chat_template(
        plain, tokenize=True, add_generation_prompt=True, return_dict=False
    )


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"role": "wizard", "content": "x"}], "role must be one of"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "unsupported content part",
        ),
        ([{"role": "user", "content": 3}], "string or a list"),
        ([{"role": "user"}], "content is required"),
        ([{"role": "assistant", "tool_calls": [{"id": "x"}]}], "with a 'function'"),
    ],
)
def test_bad_messages_raise_value_error(tok: Tokenizer, messages: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_later_system_messages_render_as_turns(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "developer", "content": "be terse"}]
    text = tok.apply_chat_template(messages)
    assert (
        text
        == "<|im_start|>user\na<|im_end|>\n<|im_start|>system\nbe terse<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_exceptions_and_missing_template_are_value_errors(tiny_qwen2_dir: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(tiny_qwen2_dir / "tokenizer.json"))
    strict = Tokenizer(hf, "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}")
    with pytest.raises(ValueError, match="chat template error: one message only"):
        strict.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(hf).apply_chat_template([{"role": "user", "content": "a"}])
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer(hf, "{% if %}").apply_chat_template([{"role": "user", "content": "a"}])
    sandboxed = Tokenizer(hf, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="chat template error"):
        sandboxed.apply_chat_template([{"role": "user", "content": "a"}])


def test_token_bytes_of_multibyte_character(tok: Tokenizer) -> None:
    ids = tok.encode("€", add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == "€".encode()
    assert tok.token_text(tok.encode("hello", add_special_tokens=False)[0]).startswith("h")
    assert tok.token_text(tok.eos_token_ids[0]) == "<|im_end|>"
    assert tok.token_bytes(tok.token_to_id("<tool_call>")) == b"<tool_call>"
    assert tok.token_bytes(tok.encode(" the", add_special_tokens=False)[0]) == b" the"


def _split_bytes_ids(tok: Tokenizer, text: str) -> list[int]:
    """Ids of text encoded one byte per token: characters necessarily span several tokens."""
    from engine.tokenizer import _bytes_to_unicode

    alphabet = _bytes_to_unicode()
    return [tok.token_to_id(alphabet[b]) for b in text.encode()]


@pytest.mark.parametrize("path", ["bytes", "window"])
def test_incremental_detokenizer_holds_back_incomplete_utf8(
    tok: Tokenizer, window_tok: Tokenizer, path: str
) -> None:
    tok = tok if path == "bytes" else window_tok
    text = "a€b你好🚀!"
    ids = _split_bytes_ids(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=tok.encode("Say:"))
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # The euro sign is 3 bytes: nothing for its first two tokens, then the whole character.
    assert deltas[1:4] == ["", "", "€"]
    assert detok.text == text
    assert detok.flush() == ""


@pytest.fixture(scope="module")
def window_tok(tiny_qwen2_dir: Path) -> Tokenizer:
    """The same tokenizer forced onto the re-decoding window path used for non-byte-level tokenizers."""
    t = Tokenizer.from_pretrained(tiny_qwen2_dir)
    t.__dict__["is_byte_level"] = False
    return t


@pytest.mark.parametrize("path", ["bytes", "window"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_matches_full_decode_on_random_tokens(
    tok: Tokenizer, window_tok: Tokenizer, path: str, skip_special_tokens: bool
) -> None:
    t = tok if path == "bytes" else window_tok
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(t.vocab_size) for _ in range(rng.randrange(1, 40))]
        ids += rng.sample(sorted(t.special_token_ids), 2)
        rng.shuffle(ids)
        detok = IncrementalDetokenizer(t, skip_special_tokens=skip_special_tokens)
        text = "".join(detok.add(i) for i in ids) + detok.flush()
        assert text == t.decode(ids, skip_special_tokens=skip_special_tokens) == detok.text


def test_byte_path_releases_invalid_bytes_at_once(tok: Tokenizer) -> None:
    from engine.tokenizer import _bytes_to_unicode

    stray = tok.token_to_id(_bytes_to_unicode()[0x80])  # a lone continuation byte: never valid
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(stray) for _ in range(3)] == ["\ufffd"] * 3


def test_incremental_detokenizer_flushes_dangling_bytes(tok: Tokenizer) -> None:
    ids = _split_bytes_ids(tok, "ok€")[:-1]
    detok = IncrementalDetokenizer(tok)
    assert detok.add_many(ids) == "ok"
    assert detok.flush() == "\ufffd"


def test_incremental_detokenizer_skips_special_tokens(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    out = detok.add_many(tok.encode("Hi", add_special_tokens=False) + [tok.eos_token_ids[0]])
    assert out + detok.flush() == "Hi"


def _stream(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], str | None]:
    emitted = []
    for p in pieces:
        m = matcher.feed(p)
        emitted.append(m.text)
        if m.stop is not None:
            return emitted, m.stop
    emitted.append(matcher.flush())
    return emitted, None


def test_stop_string_across_token_boundaries() -> None:
    emitted, stop = _stream(StopStringMatcher(["STOP"]), ["Hello S", "T", "OP and more"])
    assert stop == "STOP"
    # "S" and "ST" could begin the stop string: held back, never emitted.
    assert emitted == ["Hello ", "", ""]


def test_stop_string_false_start_is_released() -> None:
    emitted, stop = _stream(StopStringMatcher(["STOP"]), ["Hello S", "T", "ay"])
    assert stop is None
    assert emitted == ["Hello ", "", "STay", ""]


def test_stop_string_include_in_output_and_earliest_match() -> None:
    m = StopStringMatcher(["end", "\n\n"], include_stop_str_in_output=True)
    r = m.feed("line\n\nthe end")
    assert (r.text, r.stop) == ("line\n\n", "\n\n")
    assert m.feed("more").text == "" and m.stopped == "\n\n"


def test_stop_strings_with_multibyte_characters() -> None:
    emitted, stop = _stream(StopStringMatcher(["你好"]), ["a你", "b你", "好c"])
    assert (emitted, stop) == (["a", "你b", ""], "你好")


def test_stop_matcher_random_streams_equal_offline_truncation() -> None:
    rng = random.Random(1)
    stops = ["ab", "bca", "cc"]
    for _ in range(200):
        text = "".join(rng.choice("abcd") for _ in range(rng.randrange(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randrange(1, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)], strict=True)]
        emitted, stop = _stream(StopStringMatcher(stops), pieces)
        hits = [(text.find(s), s) for s in stops if s in text]
        expected = text[: min(hits)[0]] if hits else text
        assert "".join(emitted) == expected
        assert (stop is not None) == bool(hits)


def test_stop_matcher_rejects_empty_stop() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher([""])


def test_empty_tool_calls_and_template_kwargs(tok: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "tool_calls": []},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\nhello<|im_end|>\n") and "<tool_call>" not in text
    # Caller-supplied template variables win over the tokenizer's special tokens, without a TypeError.
    assert tok.apply_chat_template(messages[:1], bos_token="[B]").startswith("[B]<|im_start|>user")
