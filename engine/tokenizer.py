"""Tokenizer, chat template, incremental detokenizer and stop-string matcher. Imports no torch.

The gateway renders and tokenizes prompts with this module and the engine detokenizes with it, so both
count exactly the same tokens. Decisions and invariants:

- ``Tokenizer`` wraps the checkpoint's ``tokenizer.json`` (HF ``tokenizers``) and its chat template
  (``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``), rendered in a sandboxed,
  immutable Jinja environment with the helpers Hugging Face templates rely on (``raise_exception``,
  ``tojson``, ``strftime_now``, ``trim_blocks``/``lstrip_blocks``), so renderings match transformers'.
- ``apply_chat_template`` takes OpenAI-style messages: ``content`` is a string, ``None`` or a list of
  ``{"type": "text", "text": ...}`` parts (joined with ``"\\n"``, like vLLM); assistant ``tool_calls``
  keep the OpenAI shape but their JSON ``arguments`` string is parsed into an object, which is what
  templates expect. A rendered chat is encoded with ``add_special_tokens=False`` (the template already
  holds the BOS token where the model wants one): use ``encode_chat``. Bad messages raise ``ValueError``.
- ``eos_token_ids`` is the ordered union of ``generation_config.json``'s and ``config.json``'s
  ``eos_token_id`` and the tokenizer's ``eos_token``.
- ``IncrementalDetokenizer``: the concatenation of its deltas followed by ``flush()`` equals
  ``decode(output_ids)``; a delta never ends inside an incomplete UTF-8 sequence (held back until the
  character completes, or released by ``flush()``). For byte-level tokenizers at most 3 bytes are ever
  held back and each token costs O(1).
- ``StopStringMatcher``: the text it releases never contains a stop string nor ends with a prefix of one
  that could still complete; once a stop string matches, the output is truncated right before it (or
  after it, with ``include_stop_str_in_output``) and every later feed is ignored.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

_ROLES = ("system", "developer", "user", "assistant", "tool")
# Prompt tokens kept as context for the first detokenized output token (leading-space handling of
# tokenizers whose decode depends on the previous token, e.g. SentencePiece's "▁").
_DETOKENIZE_CONTEXT_TOKENS = 5


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _token_content(token: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken dict."""
    if isinstance(token, Mapping):
        return token.get("content")
    return token if isinstance(token, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte maps to one printable character."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


class Tokenizer:
    """A checkpoint's tokenizer and chat template. Thread-safe for encode/decode/rendering."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        chat_template: str | Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v}
        if isinstance(chat_template, str):
            chat_template = {"default": chat_template}
        self._template_sources: dict[str, str] = dict(chat_template or {})
        self._templates: dict[str, jinja2.Template] = {}
        eos = list(eos_token_ids)
        eos_token = self._special_tokens.get("eos_token")
        if eos_token is not None and (eos_id := tokenizer.token_to_id(eos_token)) is not None:
            eos.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        bos = self._special_tokens.get("bos_token")
        self.bos_token_id: int | None = tokenizer.token_to_id(bos) if bos else None
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load ``tokenizer.json``, the chat template and the EOS ids of an HF checkpoint directory."""
        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise ValueError(f"{d} has no tokenizer.json (only fast HF tokenizers are supported)")
        tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
        tok_config = _read_json(d / "tokenizer_config.json")
        template: Any = tok_config.get("chat_template")
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        elif (d / "chat_template.json").is_file():
            template = _read_json(d / "chat_template.json").get("chat_template", template)
        if isinstance(template, list):
            template = {t["name"]: t["template"] for t in template}
        special = {
            k: _token_content(tok_config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        eos = _ids(_read_json(d / "generation_config.json").get("eos_token_id"))
        eos += _ids(_read_json(d / "config.json").get("eos_token_id"))
        return cls(tok, template, special, eos)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @cached_property
    def is_byte_level(self) -> bool:
        """True for byte-level BPE: a text is exactly the concatenation of its tokens' bytes."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
        return "ByteLevel" in kinds

    @cached_property
    def _added_tokens(self) -> dict[int, str]:
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special tokens (those ``skip_special_tokens`` drops)."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (OpenAI's logprob ``bytes``); may be part of a character."""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._bytes_cache[token_id] = self._token_bytes(token_id)
        return cached

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added_tokens:  # stored as plain text, never byte-level encoded
            return self._added_tokens[token_id].encode("utf-8")
        token = self._tok.id_to_token(token_id)
        if token is None:
            return b""
        if self.is_byte_level and all(c in _BYTE_DECODER for c in token):
            return bytes(_BYTE_DECODER[c] for c in token)
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(token[3:5], 16)])
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """One token's text (OpenAI's logprob ``token``); incomplete UTF-8 becomes U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render OpenAI-style chat ``messages`` (and ``tools``) with the checkpoint's chat template."""
        if not self._template_sources:
            raise ValueError("this model has no chat template; use the completions API")
        msgs = normalize_messages(messages)
        if tools is not None:
            if not isinstance(tools, Sequence) or not all(isinstance(t, Mapping) for t in tools):
                raise ValueError("tools must be a list of objects")
            tools = [dict(t) for t in tools] or None
        name = "tool_use" if tools and "tool_use" in self._template_sources else "default"
        if name not in self._template_sources:
            name = next(iter(self._template_sources))
        template = self._templates.get(name)
        if template is None:
            try:
                template = _compile_template(self._template_sources[name])
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"the model's chat template does not compile: {e}") from e
            self._templates[name] = template
        try:
            context = {**self._special_tokens, **template_kwargs}
            return template.render(
                messages=msgs, tools=tools, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of a rendered chat (special tokens come from the template, none are added)."""
        text = self.apply_chat_template(messages, tools, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


def _content_text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"{where}.content: unsupported content part type {kind!r} (only text)")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.content: a text part needs a string 'text'")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"{where}.content must be a string or a list of text parts")


def _normalize_tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise ValueError(f"{where} must be an object with a 'function'")
    fn = dict(call["function"])
    if not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}.function.name must be a string")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            parsed = args  # rendered verbatim: the template prints strings as they are
        args = parsed
    fn["arguments"] = args
    return {**call, "function": fn}


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and bring them to the shape HF chat templates expect."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{where} must be an object")
        role = m.get("role")
        if role not in _ROLES:
            raise ValueError(f"{where}.role must be one of {_ROLES}, got {role!r}")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = _content_text(m.get("content"), where)
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, Sequence):
                raise ValueError(f"{where}.tool_calls must be a list")
            msg["tool_calls"] = [
                _normalize_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
            ]
        else:
            msg.pop("tool_calls", None)  # an empty list reads as "has tool calls" to some templates
        if msg["content"] is None and "tool_calls" not in msg:
            if role != "assistant":
                raise ValueError(f"{where}.content is required for role {role!r}")
            msg["content"] = ""
        out.append(msg)
    return out


class IncrementalDetokenizer:
    """Turns output tokens into text deltas, one token at a time (see the module invariants).

    Byte-level BPE tokenizers (GPT-2 / Llama 3 / Qwen style) take an O(1) path: each token's raw bytes
    go through an incremental UTF-8 decoder, so at most 3 bytes of an incomplete character are ever
    held back and invalid bytes come out at once as U+FFFD. Other tokenizers (SentencePiece-style,
    where a token's text depends on its neighbours) re-decode a short window of recent tokens and hold
    the delta back while it ends in U+FFFD.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._parts: list[str] = []
        self._utf8: codecs.IncrementalDecoder | None = None
        if tokenizer.is_byte_level:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._skipped_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = list(prompt_token_ids[-_DETOKENIZE_CONTEXT_TOKENS:])
        # Window path: text of _ids[_prefix:_read] was emitted already; _ids[_read:] is held back.
        self._prefix = 0
        self._read = len(self._ids)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Add one token and return the text that became final (possibly empty)."""
        if self._utf8 is not None:
            if token_id in self._skipped_ids:
                return ""
            delta = self._utf8.decode(self._tokenizer.token_bytes(token_id))
        else:
            self._ids.append(token_id)
            emitted = self._decode(self._ids[self._prefix : self._read])
            current = self._decode(self._ids[self._prefix :])
            if len(current) <= len(emitted) or current.endswith("\ufffd"):
                return ""
            delta = current[len(emitted) :]
            self._prefix, self._read = self._read, len(self._ids)
        if delta:
            self._parts.append(delta)
        return delta

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """Release held-back text (incomplete characters become U+FFFD); call when the stream ends."""
        if self._utf8 is not None:
            delta = self._utf8.decode(b"", final=True)
        elif self._read == len(self._ids):
            return ""
        else:
            emitted = self._decode(self._ids[self._prefix : self._read])
            current = self._decode(self._ids[self._prefix :])
            delta = current[len(emitted) :] if current.startswith(emitted) else ""
            self._prefix, self._read = self._read, len(self._ids)
        if delta:
            self._parts.append(delta)
        return delta


@dataclass(slots=True)
class StopMatch:
    """What one ``StopStringMatcher.feed`` call produced."""

    # Text safe to emit now.
    text: str
    # The stop string that matched, if any; the stream must end.
    stop: str | None = None


class StopStringMatcher:
    """Finds stop strings in streamed text, across token boundaries, holding back possible prefixes."""

    def __init__(self, stop: Iterable[str], include_stop_str_in_output: bool = False) -> None:
        stops = list(dict.fromkeys(stop))
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self._stops = stops
        self._include = include_stop_str_in_output
        self._pending = ""
        self.stopped: str | None = None

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def feed(self, delta: str) -> StopMatch:
        if self.stopped is not None:
            return StopMatch("", self.stopped)
        if not self._stops:
            return StopMatch(delta)
        text = self._pending + delta
        first: tuple[int, str] | None = None
        for s in self._stops:
            i = text.find(s)
            if i >= 0 and (first is None or i < first[0] or (i == first[0] and len(s) > len(first[1]))):
                first = (i, s)
        if first is not None:
            i, s = first
            self.stopped = s
            self._pending = ""
            return StopMatch(text[: i + len(s)] if self._include else text[:i], s)
        hold = self._held_back(text)
        self._pending = text[len(text) - hold :]
        return StopMatch(text[: len(text) - hold])

    def flush(self) -> str:
        """Release the held-back text when the stream ends for another reason (EOS, length)."""
        if self.stopped is not None:
            return ""
        out, self._pending = self._pending, ""
        return out
