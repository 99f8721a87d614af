import math

import pytest
import torch

from engine.sampler import Sampler, seeded_noise_seed
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

V = 64


def seq(prompt=(1, 2, 3), output=(), index=0, **params):
    s = Sequence("r", list(prompt), SamplingParams(**params), index=index)
    for t in output:
        s.append_token(t)
    return s


def logits(n, seed=0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_top_k_one_is_greedy():
    x = logits(5)
    sampler = Sampler(V)
    greedy = sampler.sample(x, [seq(temperature=0.0) for _ in range(5)])
    assert [r.token_id for r in greedy] == x.argmax(-1).tolist()
    top1 = sampler.sample(x, [seq(temperature=1.5, top_k=1) for _ in range(5)])
    assert [r.token_id for r in top1] == x.argmax(-1).tolist()


def test_seeded_row_is_identical_alone_and_in_a_busy_batch():
    x = logits(6, seed=1)
    sampler = Sampler(V, seed=123)
    target = seq(prompt=range(10), temperature=1.0, top_p=0.9, seed=42)
    alone = sampler.sample(x[2:3], [target])[0].token_id
    others = [seq(temperature=0.0), seq(temperature=0.7), seq(top_k=5), seq(seed=7), seq(temperature=1.2)]
    batch = others[:2] + [target] + others[2:]
    for _ in range(3):  # unseeded rows advance the engine generator; the seeded row must not care
        assert sampler.sample(x, batch)[2].token_id == alone
    assert Sampler(V, seed=999).sample(x[2:3], [target])[0].token_id == alone


def test_seed_noise_depends_on_position_and_stream():
    assert seeded_noise_seed(1, 0, 10) != seeded_noise_seed(1, 0, 11)
    assert seeded_noise_seed(1, 0, 10) != seeded_noise_seed(1, 1, 10)
    x = torch.zeros(1, V)  # uniform: consecutive positions should not repeat one token
    sampler = Sampler(V)
    s = seq(seed=3)
    tokens = []
    for _ in range(8):
        tokens.append(sampler.sample(x, [s])[0].token_id)
        s.append_token(tokens[-1])
    assert len(set(tokens)) > 1


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (V - 3))
    x = probs.clamp_min(1e-30).log().expand(4000, V).contiguous()
    sampler = Sampler(V, seed=0)
    tokens = torch.tensor([r.token_id for r in sampler.sample(x, [seq() for _ in range(4000)])])
    freq = torch.bincount(tokens, minlength=V).float() / 4000
    assert torch.allclose(freq[:3], probs[:3], atol=0.04) and freq[3:].sum() == 0


def test_top_k_and_top_p_restrict_the_support():
    x = torch.linspace(0, 5, V).expand(500, V).contiguous()
    sampler = Sampler(V)
    top3 = {r.token_id for r in sampler.sample(x, [seq(top_k=3) for _ in range(500)])}
    assert top3 <= {V - 1, V - 2, V - 3} and len(top3) > 1
    probs = torch.softmax(x[0], -1).sort(descending=True).values
    nucleus = int((probs.cumsum(0) - probs < 0.5).sum())
    in_nucleus = {r.token_id for r in sampler.sample(x, [seq(top_p=0.5) for _ in range(500)])}
    assert in_nucleus <= set(range(V - nucleus, V))


def test_presence_and_frequency_penalties():
    x = torch.zeros(1, V)
    x[0, 7] = 1.0
    s = seq(output=(7, 7, 9), temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    sampler = Sampler(V)
    captured = {}
    real = sampler._apply_penalties

    def spy(t, seqs):
        real(t, seqs)
        captured["x"] = t.clone()

    sampler._apply_penalties = spy
    sampler.sample(x, [s])
    expected = x.clone()
    expected[0, 7] -= 0.5 + 2 * 0.25
    expected[0, 9] -= 0.5 + 0.25
    assert torch.allclose(captured["x"], expected)
    # The penalty flips the greedy choice away from the repeated token.
    assert Sampler(V).sample(x, [s])[0].token_id != 7
    assert Sampler(V).sample(x, [seq(output=(7, 7, 9), temperature=0.0)])[0].token_id == 7


def test_repetition_penalty_covers_prompt_and_output():
    x = torch.zeros(1, V)
    x[0, 1], x[0, 2], x[0, 5] = 2.0, -1.0, 1.9
    s = seq(prompt=(1,), output=(2,), temperature=0.0, repetition_penalty=2.0)
    sampler = Sampler(V)
    processed = x.clone()
    sampler._apply_penalties(processed, sampler.inputs([s]))
    assert processed[0, 1] == 1.0 and processed[0, 2] == -2.0 and processed[0, 5] == pytest.approx(1.9)
    assert sampler.sample(x, [s])[0].token_id == 5


def test_logprobs_match_raw_log_softmax():
    x = logits(3, seed=5)
    sampler = Sampler(V)
    seqs = [seq(logprobs=5, temperature=0.7, presence_penalty=1.0, output=(1,)), seq(), seq(logprobs=0)]
    results = sampler.sample(x, seqs)
    ref = torch.log_softmax(x, -1)
    rec = results[0].logprob
    assert rec.token_id == results[0].token_id
    assert math.isclose(rec.logprob, ref[0, rec.token_id].item(), rel_tol=1e-5)
    values, ids = ref[0].topk(5)
    assert [t for t, _ in rec.top_logprobs] == ids.tolist()
    assert [lp for _, lp in rec.top_logprobs] == pytest.approx(values.tolist(), rel=1e-5)
    assert results[1].logprob is None
    assert results[2].logprob.top_logprobs == []
    assert math.isclose(results[2].logprob.logprob, ref[2, results[2].token_id].item(), rel_tol=1e-5)


def test_input_validation():
    sampler = Sampler(V)
    with pytest.raises(ValueError, match="logits must be"):
        sampler.sample(torch.zeros(2, V), [seq()])
    with pytest.raises(ValueError, match="columns"):
        sampler.sample(torch.zeros(1, V + 1), [seq()])
    with pytest.raises(ValueError, match="not available"):
        sampler.prepare(SamplingParams(json_object=True))
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler(0)


def test_seeded_generation_is_reproducible_over_many_steps_in_changing_batches():
    def run(companions_per_step):
        sampler = Sampler(V, seed=companions_per_step)
        target = seq(prompt=range(5), temperature=0.9, top_k=20, seed=1234, presence_penalty=0.3)
        gen = torch.Generator().manual_seed(0)
        for step in range(12):
            row = torch.randn(1, V, generator=gen)  # the model's logits for the target at this position
            others = [seq(temperature=1.0) for _ in range(companions_per_step * (step % 3))]
            batch = torch.cat([torch.randn(len(others), V), row]) if others else row
            target.append_token(sampler.sample(batch, others + [target])[-1].token_id)
        return target.output_token_ids

    assert run(0) == run(2) == run(5)


def test_min_p_drops_tokens_less_likely_than_a_share_of_the_best() -> None:
    x = torch.full((1, V), -30.0)
    x[0, :4] = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.15]))
    drawn = {r.token_id for r in Sampler(V).sample(x.expand(600, V), [seq(min_p=0.5) for _ in range(600)])}
    assert drawn == {0, 1}  # 0.15 < 0.5 * 0.4


def test_seeded_draws_follow_the_distribution() -> None:
    """The exponential race over hashed noise is an exact sample: 3000 streams, each its own seed."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    x = torch.full((1, V), float("-inf"))
    x[0, :5] = probs.log()
    rows = [seq(temperature=1.0, seed=s) for s in range(3000)]
    tokens = torch.tensor([r.token_id for r in Sampler(V).sample(x.expand(len(rows), V), rows)])
    freq = torch.bincount(tokens, minlength=V)[:5].float() / len(rows)
    assert torch.allclose(freq, probs, atol=0.03), freq
    assert int(tokens.max()) < 5  # a token of probability 0 is never drawn


def test_penalty_counts_live_on_the_device_and_include_tokens_the_host_has_not_seen() -> None:
    """The overlapped loop samples step N+1 before the host knows step N's token: the counts are kept
    per slot on the device, initialised once from the known tokens, and every draw is added there."""
    sampler = Sampler(V, num_slots=2)
    x = torch.zeros(1, V)
    x[0, 7], x[0, 8] = 2.0, 1.5
    s = seq(output=(3,), temperature=0.0, frequency_penalty=1.0)
    first = sampler.inputs([s])
    assert [slot for slot, _, _ in first.init] == [0]
    assert sampler.draw(x.clone(), first).host().token_ids == [7]
    # The host has not appended 7 yet, and does not initialise the slot again: the device counted it.
    later = sampler.inputs([s])
    later.init = []
    assert sampler.draw(x.clone(), later).host().token_ids == [8]  # 2.0 - 1.0 < 1.5


def test_logprobs_without_alternatives_for_every_row() -> None:
    """OpenAI's ``logprobs: true`` with the default ``top_logprobs`` 0, alone in a batch."""
    x = logits(2, seed=9)
    results = Sampler(V).sample(x, [seq(logprobs=0, temperature=0.0), seq(logprobs=0)])
    ref = torch.log_softmax(x, -1)
    for i, r in enumerate(results):
        assert r.logprob is not None and r.logprob.top_logprobs == []
        assert math.isclose(r.logprob.logprob, ref[i, r.token_id].item(), rel_tol=1e-5)


def test_seeded_draws_never_leave_the_support_of_a_large_vocabulary() -> None:
    """The hashed noise is never 0 (a uniform of 1.0 would give p / 0 and pick a masked token)."""
    vocab = 152_000
    x = torch.full((400, vocab), float("-inf"))
    x[:, 10:20] = 0.0
    rows = [Sequence("r", [1], SamplingParams(temperature=1.0, seed=s)) for s in range(400)]
    tokens = {r.token_id for r in Sampler(vocab).sample(x, rows)}
    assert tokens <= set(range(10, 20))
