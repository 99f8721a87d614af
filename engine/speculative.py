"""Speculative decoding: draft tokens for a sequence's next step, and the policy that decides how many.

A sequence may carry ``k`` draft tokens into a step: the runner computes its last known token and the
``k`` drafts in one forward pass (k + 1 query positions), the sampler draws a token at each position as
it would without drafts, and the engine keeps the drafts up to the first one that differs from the
drawn token, then the drawn token there. Every emitted token is thus exactly what decoding without
drafts would have drawn at its position (greedy: the argmax; seeded: the same noise; unseeded: an exact
sample), so speculation changes how many tokens a step yields, never which. Rejected positions' K/V
are dead: ``num_computed_tokens`` rolls back to the accepted ones, their blocks' hashes are computed from
known tokens only, so they never enter the prefix cache or a tier, and the next step overwrites them.

Proposers (per sequence, pure Python, nothing shared between requests, let alone tenants):

- ``PredictionProposer``: the request's ``prediction`` (OpenAI's Predicted Outputs, tokenized by the
  gateway), followed along the output by text (bytes), so that the model writing the same text in other
  tokens does not lose it. After a mismatch (an edit inserted or deleted text) it re-anchors on the
  output's last bytes: the next place after its cursor where the prediction's text has them.
- ``PromptLookupProposer``: automatic speculation for every request: the tokens that followed the most
  recent earlier occurrence of the output's last ``n`` tokens (n from ``max_ngram`` down to
  ``min_ngram``) in the request's own prompt and output (agents quote their context).

``SpeculationPolicy`` decides per step: nothing when more than ``max_batch`` sequences run (verifying k
extra positions stops being free as the batch grows; at high load speculation only slows serving), and
per sequence up to ``max_draft`` tokens, fewer as its measured acceptance falls, none below
``min_acceptance`` (re-probed every ``probe_every`` steps). Sequences with penalties never speculate
here. Structured output does: each row is masked with the grammar state after the drafts before it
(``engine.grammar``), so a draft the grammar forbids is rejected like any draft the model would not draw.

Torch-free: unit-tested on any machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams

_ACCEPTANCE_EWMA = 0.3


def _id_bytes(token_id: int) -> bytes:
    """A token as four bytes of its id: the "text" of a model without a tokenizer."""
    return token_id.to_bytes(4, "big")


def _id_encode(text: bytes) -> list[int]:
    return [int.from_bytes(text[i:i + 4], "big") for i in range(0, len(text) - len(text) % 4, 4)]


class PredictionProposer:
    """Drafts from a predicted output, followed by its text (bytes), not by its token ids.

    OpenAI's Predicted Outputs are text, and the same text has many tokenizations: the gateway tokenizes
    the prediction one way, and the model may write the same characters in other tokens. So the cursor is
    a byte offset into the prediction's text, moved along by the bytes of each token the output gains.
    Drafts are the prediction's own tokens from the cursor where it sits on one of their boundaries, else
    the prediction's next text re-tokenized from the cursor (``encode``). After a mismatch the cursor is
    lost until the output's last ``anchor`` bytes appear in the prediction again, at or after the cursor
    (an edit replaced, inserted or deleted text, and the rest still matches); the drafts continue there.

    It counts the prediction's tokens as drafted: those that made it into the output (``num_accepted``)
    and those that did not (``num_rejected``), each draft position (its byte offset) at most once,
    however often a re-anchored draft is tried again. ``token_bytes``/``encode``: the tokenizer's (a
    token id as its bytes; text to token ids); without them token ids stand for themselves.

    Where the cursor is not on a boundary of the prediction's tokens, the model is writing the text in its
    own way (a random or fine-tuned model may prefer "LE" + "LE" where the tokenizer says "L" + "EL"):
    the drafts are then the model's own earlier tokens that spelled the upcoming text, found in its
    output so far, and only failing that the text re-tokenized."""

    def __init__(self, prediction: list[int], anchor: int = 12,
                 token_bytes: Callable[[int], bytes] | None = None,
                 encode: Callable[[str], list[int]] | None = None) -> None:
        self.prediction = list(prediction)
        self._token_bytes = token_bytes or _id_bytes
        self._encode: Callable[[bytes], list[int]]
        if encode is None:
            self._encode = _id_encode
            self.anchor = 3 * 4  # three tokens' ids
        else:
            text_encode = encode
            self._encode = lambda raw: text_encode(_whole_characters(raw))
            self.anchor = anchor
        pieces = [self._token_bytes(t) for t in self.prediction]
        self.text = b"".join(pieces)
        self._starts: dict[int, int] = {}  # byte offset of a prediction token -> its index
        offset = 0
        for index, piece in enumerate(pieces):
            self._starts.setdefault(offset, index)
            offset += len(piece)
        self.cursor = 0  # the prediction's byte expected next (while lost: where it last matched)
        self.lost = False
        # The output's tokens, their bytes (re-anchoring looks for the last ones) and where each starts.
        self._output: list[int] = []
        self._output_text = bytearray()
        self._output_starts: dict[int, int] = {}
        self._draft_offsets: list[int] = []
        self._accepted: set[int] = set()
        self._rejected: set[int] = set()

    @property
    def num_accepted(self) -> int:
        return len(self._accepted)

    @property
    def num_rejected(self) -> int:
        return len(self._rejected)

    def ready(self) -> bool:
        """Whether it has something to draft (not lost, not used up)."""
        return not self.lost and self.cursor < len(self.text)

    def observe(self, output: list[int], num_new: int) -> None:
        """The output grew by its last ``num_new`` tokens: move the cursor along the prediction's text."""
        text = self.text
        for token in output[len(output) - num_new:]:
            piece = self._token_bytes(token)
            self._output_starts[len(self._output_text)] = len(self._output)
            self._output.append(token)
            self._output_text += piece
            if not piece:
                continue
            if not self.lost and text.startswith(piece, self.cursor):
                self.cursor += len(piece)
                continue
            found = self._find(bytes(self._output_text[-self.anchor:]))
            self.lost = found is None
            if found is not None:
                self.cursor = found

    def _find(self, tail: bytes) -> int | None:
        """Just after the first place at or after the cursor where the prediction's text holds ``tail``."""
        if len(tail) < self.anchor:
            return None
        at = self.text.find(tail, self.cursor)
        return None if at < 0 else at + len(tail)

    def propose(self, tokens: list[int], max_draft: int) -> list[int]:
        if not self.ready() or max_draft <= 0:
            return []
        index = self._starts.get(self.cursor)
        if index is not None:
            drafts = self.prediction[index:index + max_draft]
        else:  # the output left the prediction's tokenization
            window = self.text[self.cursor:self.cursor + 16 * max_draft]
            drafts = self._as_written_before(window, max_draft)
            if not drafts:  # its next text, tokenized from here
                drafts = self._encode(window)
                if self.cursor + len(window) < len(self.text):
                    drafts = drafts[:-1]  # the window may have cut the last token short
                drafts = drafts[:max_draft]
        # Keep the drafts whose bytes follow the prediction's text from the cursor; note where each starts.
        self._draft_offsets = []
        offset = self.cursor
        for i, token in enumerate(drafts):
            piece = self._token_bytes(token)
            if not piece or not self.text.startswith(piece, offset):
                drafts = drafts[:i]
                break
            self._draft_offsets.append(offset)
            offset += len(piece)
        return drafts

    def _as_written_before(self, upcoming: bytes, max_draft: int) -> list[int]:
        """The model's own tokens that last spelled the start of ``upcoming`` in its output (from one of
        its token boundaries, as many as keep matching), or []."""
        key = upcoming[:8]
        text, end = self._output_text, len(self._output_text)
        while key:
            at = text.rfind(key, 0, end)
            if at < 0:
                return []
            end = at + len(key) - 1
            index = self._output_starts.get(at)
            if index is None:
                continue
            drafts, offset = [], 0
            for token in self._output[index:index + max_draft]:
                piece = self._token_bytes(token)
                if not piece or not upcoming.startswith(piece, offset):
                    break
                drafts.append(token)
                offset += len(piece)
            if drafts:
                return drafts
        return []

    def verified(self, num_drafted: int, num_kept: int) -> None:
        """The last drafts were verified: the first ``num_kept`` made it into the output."""
        for i, offset in enumerate(self._draft_offsets[:num_drafted]):
            if i < num_kept:
                self._accepted.add(offset)
                self._rejected.discard(offset)
            elif offset not in self._accepted:
                self._rejected.add(offset)


def _whole_characters(raw: bytes) -> str:
    """``raw`` as text, without a character its end cuts short (a window of the prediction's bytes)."""
    for cut in range(4):
        try:
            return raw[:len(raw) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return raw.decode("utf-8", errors="ignore")


class PromptLookupProposer:
    """Drafts from the request's own tokens: what followed the latest earlier match of the last n-gram.

    The index maps each n-gram (packed into one integer per ``n``) to the position after its latest
    occurrence, grown as tokens are appended. ``ready`` is False after a lookup found nothing, until
    ``probe_every`` steps have passed (so an engine that overlaps its steps does not stop to look for
    drafts that are not there)."""

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4, probe_every: int = 8) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.probe_every = probe_every
        self._latest: list[dict[int, int]] = [{} for _ in range(max_ngram + 1)]
        self._indexed = 0  # n-grams ending before tokens[_indexed] are in the index
        self._idle = 0  # steps since a lookup last found something (0: it did)

    @staticmethod
    def _key(tokens: list[int], start: int, end: int) -> int:
        key = 0
        for token in tokens[start:end]:
            key = (key << 32) | token
        return key

    def _index(self, tokens: list[int]) -> None:
        # An n-gram ending at i - 1 (followed by tokens[i]) is recorded once tokens[i] exists, so the
        # match for the sequence's own last n-gram is always an earlier one.
        for end in range(max(self._indexed, self.min_ngram), len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._latest[n][self._key(tokens, end - n, end)] = end
        self._indexed = max(self._indexed, len(tokens))

    def ready(self) -> bool:
        if self._idle == 0:
            return True
        self._idle += 1
        return self._idle % self.probe_every == 0

    def propose(self, tokens: list[int], max_draft: int) -> list[int]:
        self._index(tokens)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) < n:
                continue
            at = self._latest[n].get(self._key(tokens, len(tokens) - n, len(tokens)))
            if at is not None:
                self._idle = 0
                return tokens[at:at + max_draft]
        self._idle = max(self._idle, 1)
        return []

    def observe(self, output: list[int], num_new: int) -> None:
        pass


@dataclass(slots=True)
class SpeculationState:
    """A sequence's proposer and its measured acceptance (drafted vs accepted tokens, an EWMA)."""

    proposer: PredictionProposer | PromptLookupProposer
    from_prediction: bool
    acceptance: float = 0.6  # a prior: the first steps draft most of the way
    steps_off: int = 0  # steps since it last drafted (while acceptance is below the floor)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            rate = num_accepted / num_drafted
            self.acceptance += _ACCEPTANCE_EWMA * (rate - self.acceptance)


@dataclass(slots=True)
class SpeculationPolicy:
    """How far to speculate. ``max_draft``: tokens per sequence and step (automatic lookups);
    ``max_prediction_draft``: with a request's prediction (usually long stretches that match)."""

    max_draft: int = 4
    max_prediction_draft: int = 8
    max_batch: int = 16
    min_acceptance: float = 0.15
    probe_every: int = 16
    automatic: bool = True

    @classmethod
    def from_config(cls, config: EngineConfig) -> SpeculationPolicy | None:
        """The engine's policy (``config.speculation``: ``auto`` predictions and prompt lookup,
        ``prediction`` only requests' predictions, ``off``); None when off."""
        if config.speculation == "off":
            return None
        return cls(max_draft=config.num_speculative_tokens, max_prediction_draft=config.num_prediction_tokens,
                   max_batch=config.speculative_max_batch, automatic=config.speculation == "auto")

    def state(self, prediction: list[int] | None, token_bytes: Callable[[int], bytes] | None = None,
              encode: Callable[[str], list[int]] | None = None) -> SpeculationState | None:
        """A new sequence's speculation: following its prediction (by text, with the tokenizer's
        ``token_bytes`` and ``encode``), else (automatic) its own tokens."""
        if prediction:
            proposer = PredictionProposer(prediction, token_bytes=token_bytes, encode=encode)
            return SpeculationState(proposer, True)
        if self.automatic and self.max_draft > 0:
            return SpeculationState(PromptLookupProposer(), False)
        return None

    def active(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` sequences speculates at all."""
        return 0 < num_running <= self.max_batch and (self.max_draft > 0 or self.max_prediction_draft > 0)

    def draft_length(self, state: SpeculationState) -> int:
        """How many drafts this sequence may carry this step (0: none; its proposer has nothing, or its
        drafts are mostly rejected and this is not a probe)."""
        limit = self.max_prediction_draft if state.from_prediction else self.max_draft
        if limit <= 0 or not state.proposer.ready():
            return 0
        if state.acceptance < self.min_acceptance:
            state.steps_off += 1
            if state.steps_off < self.probe_every:
                return 0
            state.steps_off = 0
            return 1  # a probe
        # Expected accepted tokens grow with the acceptance; past it, drafts are mostly waste.
        return max(1, min(limit, round(limit * state.acceptance)))


def accepted_prefix(drafts: list[int], drawn: list[int]) -> int:
    """How many drafts stand: those before the first that differs from the token drawn at its position.

    Exact rejection sampling for deterministic drafts: a draft ``d`` stands with probability ``p(d)``
    (the chance the draw is ``d``), and where it falls the emitted token is the draw, distributed as ``p``
    without ``d``, renormalised: the residual ``max(0, p - q)`` of a point mass ``q`` at ``d``."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == drawn[accepted]:
        accepted += 1
    return accepted


def speculates(params: SamplingParams) -> bool:
    """Whether a request may speculate: not with penalties (a draft's row would need the counts of the
    drafts before it, and the device counts every row's draw). Structured output may: its matcher walks
    the drafts when the masks are filled."""
    return not (params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)
