"""A tiny checkpoint that copies its context: the model automatic speculation is measured with.

A random-weight model never repeats its context, so prompt lookup never finds a draft it accepts. This
checkpoint is a two-layer Llama whose weights are an induction circuit written down, not learnt: it
predicts what followed the latest earlier occurrence of its last tokens (up to ``CONTEXT`` = 10 of them,
the more the better), so once its output has begun to quote the context it goes on quoting it token for
token, as an agent quoting a tool's output or a file does, and ends where the quoted message ended.
Where nothing matches, its output is as arbitrary as a random model's. A stretch of 10 tokens that occurs
twice in the context is a fork: the quote goes on from the latest occurrence. It is a real
``LlamaForCausalLM`` with ``engine.tiny``'s tokenizer and chat template; the engine and ``transformers``
load and run it to the same tokens. Written in a second, byte-identical for a seed.

The residual stream is split into blocks (``_Layout``): ``A`` the token's embedding (a random vector of
``CONTENT`` dims whose first ``MATCH`` dims are the part compared), ``B1``..``B10`` the compared parts of
the tokens 1..10 back, ``D`` what the induction head copied, a constant dimension ``C`` and a flag ``F``
on the chat template's structure tokens. Layer 0's ten heads are position-only (query and key come from
``C``): RoPE phases over the high-frequency pairs make head h score offset h + 1 highest, and it copies
that token's compared part into ``B{h+1}``. Layer 1's head 0 is the induction head: its query holds this
token and the 9 before it, its key at position j the 10 tokens before j, in the low-frequency pairs that
turn less than 0.06 rad over the whole context, so the score counts matching tokens, aligned. A constant
term in a mid-frequency pair prefers recent matches among equals, and a key whose own token is flagged
(``<|im_start|>``, BOS) is never matched, so a quote never runs into the template's joints. Its value
copies ``A`` into ``D``; the LM head reads ``D`` against every token's embedding, plus a small random
function of ``A`` and ``B1`` that decides where nothing matches. The MLPs are zero.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.tiny import BOS_TOKEN, PAD_TOKEN, create_tiny_checkpoint

CONTENT = 96  # dims of a token's embedding (A, D): what the LM head tells tokens apart by
MATCH = 32  # the first MATCH of them: what the induction head compares (B1..B10 hold these)
CONTEXT = 10  # tokens compared: a quote continues from the latest place its last 10 tokens occurred
HEAD_DIM = 384  # 192 RoPE pairs: 8 high-frequency ones for position, 160 low ones for content
PAIR_DECADES = 7  # pair f turns by 10^(-f / 7) radians per position
ROPE_THETA = 10.0 ** (HEAD_DIM / 2 / PAIR_DECADES)  # ~2.7e27
MAX_POSITIONS = 2048
POSITION_PAIRS = range(0, 8)  # layer 0: turn by 1 to 0.1 rad per position
RECENCY_PAIR = 20  # turns by 2.8 rad over MAX_POSITIONS: cos falls with distance throughout
FLAG_PAIR = 31  # turns by 0.08 rad at most over MAX_POSITIONS
CONTENT_PAIRS = range(32, 192)  # 160 pairs, 320 dims (0.06 rad at most): 10 tokens of MATCH dims each
POSITION_MARGIN = 30.0  # logits between the right offset and any other, in layer 0's heads
MATCH_SCALE = 25.0  # logits per matching token in the induction head
RECENCY_SCALE = 8.0  # logits between the nearest and the farthest match of equal score
FLAG_PENALTY = 400.0  # logits off a key whose own token is flagged
COPY_SCALE = 40.0  # LM head logit of the copied token (others: its cosine with it, times this)
FALLBACK_STD = 1.5  # spread of the LM head's logits from a random function of (token, token before)
NUM_HEADS = CONTEXT  # layer 0 needs one per offset; layer 1 uses its first
# The chat template's joints: a quote never continues into them.
FLAGGED_TOKENS = ("<|im_start|>", BOS_TOKEN, PAD_TOKEN)


@dataclass(frozen=True)
class _Layout:
    """Offsets of the residual stream's blocks (see the module docs): A, B1..B10, D, C, F."""

    a: int = 0
    b: int = CONTENT  # B_k (k = 1..CONTEXT) starts at b + (k - 1) * MATCH
    d: int = CONTENT + CONTEXT * MATCH
    c: int = 2 * CONTENT + CONTEXT * MATCH
    f: int = 2 * CONTENT + CONTEXT * MATCH + 1
    hidden: int = 640  # a multiple of 64 and of NUM_HEADS (transformers checks the latter)

    def back(self, k: int) -> int:
        return self.b + (k - 1) * MATCH


def _inv_freq() -> torch.Tensor:
    return 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))


def _position_scale(offset: int) -> float:
    """The factor on ``sum_f cos(theta_f (distance - offset))`` over ``POSITION_PAIRS`` that makes
    ``offset`` layer 0's best distance by ``POSITION_MARGIN`` over every other in 0..MAX_POSITIONS."""
    theta = _inv_freq()[list(POSITION_PAIRS)]
    distance = torch.arange(MAX_POSITIONS, dtype=torch.float64)
    scores = torch.cos(theta[None, :] * (distance[:, None] - offset)).sum(1)
    others = torch.cat([scores[:offset], scores[offset + 1 :]])
    return POSITION_MARGIN / float(scores[offset] - others.max())


def copying_weights(vocab_size: int, flagged: list[int], seed: int) -> dict[str, torch.Tensor]:
    """HF-named float32 weights of the copying model (see the module docs)."""
    g = torch.Generator().manual_seed(seed)
    lay = _Layout()
    hidden, half, kv = lay.hidden, HEAD_DIM // 2, HEAD_DIM  # one KV head
    embed = torch.randn(vocab_size, CONTENT, generator=g, dtype=torch.float64)
    embed[:, :MATCH] /= embed[:, :MATCH].norm(dim=1, keepdim=True)  # matching parts: unit vectors
    embed[:, MATCH:] /= embed[:, MATCH:].norm(dim=1, keepdim=True)
    embed /= math.sqrt(2)  # |e| = 1, |u| = 1 / sqrt(2)
    # The embedding's norm alpha and the constant gamma give layer 0's input an RMS of 1 exactly.
    alpha = gamma = math.sqrt(hidden / 2)
    scale = 1.0 / math.sqrt(HEAD_DIM)  # the attention's softmax scale, undone in the queries
    theta = _inv_freq()

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=torch.float64)

    w = {"model.embed_tokens.weight": zeros(vocab_size, hidden)}
    w["model.embed_tokens.weight"][:, lay.a : lay.a + CONTENT] = alpha * embed
    w["model.embed_tokens.weight"][:, lay.c] = gamma
    w["model.embed_tokens.weight"][flagged, lay.f] = 1.0
    for i in range(2):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.float64)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.float64)
        w[p + "self_attn.q_proj.weight"] = zeros(NUM_HEADS * HEAD_DIM, hidden)
        w[p + "self_attn.k_proj.weight"] = zeros(kv, hidden)
        w[p + "self_attn.v_proj.weight"] = zeros(kv, hidden)
        w[p + "self_attn.o_proj.weight"] = zeros(hidden, NUM_HEADS * HEAD_DIM)
        for name in ("gate_proj", "up_proj"):
            w[p + f"mlp.{name}.weight"] = zeros(64, hidden)
        w[p + "mlp.down_proj.weight"] = zeros(hidden, 64)

    # Layer 0 (input RMS 1: normed C is gamma, normed A is alpha * e): the shared key is (1, 0) in every
    # position pair; head h's query is (cos, -sin)(offset theta), so it scores cos(theta (i - j - offset)),
    # and copies the matching part of the token `offset` back into B_offset.
    p = "model.layers.0.self_attn."
    for f in POSITION_PAIRS:
        w[p + "k_proj.weight"][f, lay.c] = 1.0 / gamma
    for d in range(MATCH):
        w[p + "v_proj.weight"][d, lay.a + d] = 1.0 / alpha
    for h in range(NUM_HEADS):
        offset, amplitude = h + 1, _position_scale(h + 1) / scale
        for f in POSITION_PAIRS:
            phase = offset * float(theta[f])
            w[p + "q_proj.weight"][h * HEAD_DIM + f, lay.c] = amplitude * math.cos(phase) / gamma
            w[p + "q_proj.weight"][h * HEAD_DIM + f + half, lay.c] = -amplitude * math.sin(phase) / gamma
        for d in range(MATCH):
            w[p + "o_proj.weight"][lay.back(offset) + d, h * HEAD_DIM + d] = alpha

    # Layer 1's input: A of norm alpha, B_k of norm alpha / sqrt(2) each, C = gamma.
    rms1 = math.sqrt((alpha**2 + CONTEXT * alpha**2 / 2 + gamma**2) / hidden)
    unit = alpha / rms1  # the normed A's norm; a normed B_k's is unit / sqrt(2), as is the normed u
    p = "model.layers.1.self_attn."
    dims = [f for pair in CONTENT_PAIRS for f in (pair, pair + half)]
    match = math.sqrt(2 * MATCH_SCALE) / unit  # a q or k coefficient: matching u's give MATCH_SCALE
    for k in range(CONTEXT):
        query_from = lay.a if k == 0 else lay.back(k)  # this token, then 1..9 back
        for d in range(MATCH):
            w[p + "q_proj.weight"][dims[k * MATCH + d], query_from + d] = match / scale
            w[p + "k_proj.weight"][dims[k * MATCH + d], lay.back(k + 1) + d] = match
    for d in range(CONTENT):
        w[p + "v_proj.weight"][d, lay.a + d] = 1.0 / unit
        w[p + "o_proj.weight"][lay.d + d, d] = alpha
    normed_c = gamma / rms1
    recency = math.sqrt(RECENCY_SCALE / (1 - math.cos(theta[RECENCY_PAIR] * MAX_POSITIONS)))
    w[p + "q_proj.weight"][RECENCY_PAIR, lay.c] = recency / normed_c / scale
    w[p + "k_proj.weight"][RECENCY_PAIR, lay.c] = recency / normed_c
    # The flag: a constant query against the key's flag (the normed F of a flagged token is 1 / rms1).
    w[p + "q_proj.weight"][FLAG_PAIR, lay.c] = -FLAG_PENALTY / normed_c / scale
    w[p + "k_proj.weight"][FLAG_PAIR, lay.f] = rms1

    # The LM head: the copied embedding in D against every token's, plus the fallback from A and B1.
    w["model.norm.weight"] = torch.ones(hidden, dtype=torch.float64)
    head = zeros(vocab_size, hidden)
    head[:, lay.d : lay.d + CONTENT] = COPY_SCALE / unit * embed
    fallback = torch.randn(vocab_size, CONTENT + MATCH, generator=g, dtype=torch.float64)
    head[:, lay.a : lay.a + CONTENT + MATCH] = FALLBACK_STD / unit * fallback
    w["lm_head.weight"] = head
    return {k: v.float().contiguous() for k, v in w.items()}


def create_copying_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the copying checkpoint into ``out_dir`` (created if needed): ``engine.tiny``'s tokenizer and
    files, this module's shape and weights."""
    out = create_tiny_checkpoint(out_dir, arch="llama", seed=seed)
    config = json.loads((out / "config.json").read_text())
    lay = _Layout()
    config.update(
        hidden_size=lay.hidden, num_attention_heads=NUM_HEADS, num_key_value_heads=1, head_dim=HEAD_DIM,
        intermediate_size=64, num_hidden_layers=2, max_position_embeddings=MAX_POSITIONS,
        rope_theta=ROPE_THETA, rms_norm_eps=1e-6,
    )
    config.pop("rope_scaling", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    flagged: list[int] = []
    for token in FLAGGED_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:  # engine.tiny's vocabulary has them all
            raise RuntimeError(f"the tiny checkpoint's tokenizer has no {token!r}")
        flagged.append(token_id)
    weights = copying_weights(config["vocab_size"], flagged, seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
