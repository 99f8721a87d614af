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
  gateway), followed along the output. After a mismatch (an edit inserted or deleted text) it re-anchors
  on the last ``anchor`` output tokens: the next place after its cursor where the prediction has them.
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

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams

_ACCEPTANCE_EWMA = 0.3
MODES = ("auto", "prediction", "off")


class PredictionProposer:
    """Drafts from a predicted output. The cursor follows the output along the prediction; after a
    mismatch it is lost until the output's last ``anchor`` tokens appear in the prediction again, at or
    after the cursor (an edit replaced, inserted or deleted text, and the rest of the file still
    matches); the drafts then continue from there. It counts the prediction's tokens by position: those
    drafted that made it into the output (``num_accepted``) and those drafted that did not
    (``num_rejected``), each position at most once, however often a re-anchored draft is tried again."""

    def __init__(self, prediction: list[int], anchor: int = 3) -> None:
        self.prediction = list(prediction)
        self.anchor = anchor
        self.cursor = 0  # the prediction's token expected next (while lost: where it last matched)
        self.lost = False
        self._ends: dict[tuple[int, ...], list[int]] | None = None  # anchor-gram -> its end positions
        self._draft_start = 0
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
        return not self.lost and self.cursor < len(self.prediction)

    def observe(self, output: list[int], num_new: int) -> None:
        """The output grew by its last ``num_new`` tokens: move the cursor along the prediction."""
        prediction = self.prediction
        for end in range(len(output) - num_new, len(output)):
            token = output[end]
            if not self.lost and self.cursor < len(prediction) and prediction[self.cursor] == token:
                self.cursor += 1
                continue
            found = self._find(output[max(0, end + 1 - self.anchor):end + 1])
            self.lost = found is None
            if found is not None:
                self.cursor = found

    def _find(self, tail: list[int]) -> int | None:
        """Just after the first place at or after the cursor where the prediction holds ``tail``
        (an index of the prediction's anchor-grams, built on the first miss, then a bisection)."""
        if len(tail) < self.anchor:
            return None
        if self._ends is None:
            ends: dict[tuple[int, ...], list[int]] = {}
            p, n = self.prediction, self.anchor
            for start in range(len(p) - n + 1):
                ends.setdefault(tuple(p[start:start + n]), []).append(start + n)
            self._ends = ends
        positions = self._ends.get(tuple(tail))
        if not positions:
            return None
        i = bisect.bisect_left(positions, self.cursor + self.anchor)
        return positions[i] if i < len(positions) else None

    def propose(self, tokens: list[int], max_draft: int) -> list[int]:
        if not self.ready():
            return []
        self._draft_start = self.cursor
        return self.prediction[self.cursor:self.cursor + max_draft]

    def verified(self, num_drafted: int, num_kept: int) -> None:
        """The last drafts were verified: the first ``num_kept`` made it into the output."""
        start = self._draft_start
        for position in range(start, start + num_drafted):
            if position < start + num_kept:
                self._accepted.add(position)
                self._rejected.discard(position)
            elif position not in self._accepted:
                self._rejected.add(position)


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
    drafted: int = 0
    accepted: int = 0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            self.drafted += num_drafted
            self.accepted += num_accepted
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

    def state(self, prediction: list[int] | None) -> SpeculationState | None:
        """A new sequence's speculation: following its prediction, else (automatic) its own tokens."""
        if prediction:
            return SpeculationState(PredictionProposer(prediction), True)
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
