"""The Llama-style decoder as plain ``nn.Module``s over the paged KV cache: Llama, Mistral, Qwen2, Qwen3,
and the mixtures of experts built on the same attention (Qwen3-MoE, Mixtral, GLM-4.5).

One implementation covers the variants, switched by ``ModelArgs``: GQA, RoPE (rope_theta, linear or
llama3-style scaling; rotate-half layout; GLM's partial rotary dimensions), RMSNorm, SwiGLU, Qwen2's q/k/v
biases, Qwen3's per-head q/k RMSNorm and explicit ``head_dim``, tied embeddings, and per layer a dense
MLP or a ``MoE`` block (``engine.models.moe``: router, grouped experts, shared expert). Invariants:

- Inputs are packed: a step's new tokens of every sequence are rows of one ``[T]`` tensor (no padding,
  no batch dimension); ``positions [T]`` are their positions inside their own sequences.
- ``q``/``k``/``v`` and ``gate``/``up`` are fused (``qkv_proj``, ``gate_up_proj``); ``engine.loader``
  fills them from HF's separate tensors. Parameter names otherwise mirror HF's.
- The model holds no per-step state: the KV cache (one tensor per layer) and ``AttentionMetadata`` are
  arguments of ``forward``; the attention math is the backend's (``engine.attention``).
- Elementwise ops (RMSNorm with the residual add fused in, RoPE, SiLU-and-mul) come from an ``Ops``
  object: ``NativeOps`` (``TorchOps``, plain PyTorch with HF rounding, except that float32 CPU calls run
  the fused C kernels of ``engine.cpu_kernels`` when they could be built) or, with
  ``fused_kernels=True``, ``TritonOps`` (the ``kernels/`` launchers, same rounding points). The runner
  turns the Triton kernels on for CUDA + triton.
- ``forward`` returns the final hidden states ``[T, hidden]``; ``compute_logits`` projects only the
  rows the caller selects, so a prefill of many tokens never materialises ``[T, vocab]``.
- Tensor parallelism (``tp``, ``engine.distributed``): this rank's heads, MLP columns and vocabulary
  rows; ``o_proj``/``down_proj`` all-reduce, the embedding all-reduces, ``compute_logits`` all-gathers
  (every rank returns the whole ``[N, vocab]``). The hidden states are whole on every rank. Without
  ``tp`` (a group of one) the layers are the plain PyTorch ones.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.distributed import ShardSizes, TensorParallel
from engine.models.config import ModelArgs
from engine.models.parallel_layers import RowParallelLinear, VocabParallelEmbedding


class TorchOps:
    """Reference elementwise ops in PyTorch, rounding like the Hugging Face implementations."""

    @staticmethod
    def rms_norm(
        x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x: [..., dim]; with residual: (norm(x + residual), x + residual)
        if residual is not None:
            x = x + residual
        xf = x.float()
        out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return out if residual is None else (out, x)

    @staticmethod
    def rotary(
        q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, KVH, D]; rotate-half layout; cos_sin: [P, D] (cos | sin), float32
        cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each

        def rotate(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x.float().chunk(2, dim=-1)
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

        return rotate(q), rotate(k)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # x: [T, 2I] -> [T, I]
        return F.silu(gate) * up


class TritonOps:
    """The same ops as fused Triton kernels (``kernels/``): one launch each, no intermediate tensors."""

    def __init__(self) -> None:
        import kernels

        self.rms_norm = kernels.rms_norm
        self.silu_and_mul = kernels.silu_and_mul
        self._rotary = kernels.rotary_embedding

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rotary(q, k, positions, cos_sin)


def _cpu_float32_kernels(x: torch.Tensor) -> cpu_kernels.Library | None:
    return cpu_kernels.library() if x.device.type == "cpu" and x.dtype == torch.float32 else None


class NativeOps(TorchOps):
    """``TorchOps`` whose float32 CPU calls run the fused C kernels of ``engine.cpu_kernels`` (one pass
    each instead of 3-8 PyTorch ops); other dtypes and devices, odd layouts, or a host where the kernels
    cannot be built take ``TorchOps``' path."""

    def rms_norm(  # type: ignore[override]
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        lib = _cpu_float32_kernels(x)
        out = None if lib is None else cpu_kernels.rms_norm(lib, x, weight, eps, residual)
        return TorchOps.rms_norm(x, weight, eps, residual) if out is None else out

    def rotary(  # type: ignore[override]
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lib = _cpu_float32_kernels(q)
        out = None if lib is None else cpu_kernels.rotary(lib, q, k, positions, cos_sin)
        return TorchOps.rotary(q, k, positions, cos_sin) if out is None else out

    def norm_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        norms: tuple[RMSNorm, RMSNorm],
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-head RMSNorm of q and k (``norms``, Qwen3) then RoPE in one kernel; None where the kernel
        does not apply (the caller then runs the two steps)."""
        lib = _cpu_float32_kernels(q)
        if lib is None or norms[0].eps != norms[1].eps:
            return None
        weights = (norms[0].weight, norms[1].weight)
        return cpu_kernels.rotary(lib, q, k, positions, cos_sin, weights, norms[0].eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        lib = _cpu_float32_kernels(x)
        out = None if lib is None else cpu_kernels.silu_and_mul(lib, x)
        return TorchOps.silu_and_mul(x) if out is None else out


Ops = TorchOps | TritonOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self._ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        return self._ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim / 2]`` (float32), with linear, llama3 or YaRN scaling applied."""
    dim = args.rotary_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    p = args.rope_params
    if args.rope_type == "linear":
        return inv_freq / p["factor"]
    if args.rope_type == "yarn":
        return _yarn_inv_freq(args.rope_theta, dim, p)
    if args.rope_type == "llama3":
        factor = p["factor"]
        low, high = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
        old_len = p.get("original_max_position_embeddings", 8192.0)
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, the band between
        # interpolated smoothly.
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(wavelen < old_len / high, inv_freq, torch.where(wavelen > old_len / low,
                                                                            inv_freq / factor, scaled))
    return inv_freq


def _yarn_inv_freq(base: float, dim: int, p: dict[str, float]) -> torch.Tensor:
    """YaRN: frequencies rotating fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), those rotating more than ``beta_fast`` times kept, with a linear
    ramp between (over dimension indices, truncated to integers unless ``truncate`` is 0)."""
    factor, original = p["factor"], p.get("original_max_position_embeddings", 4096.0)
    beta_fast, beta_slow = p.get("beta_fast") or 32.0, p.get("beta_slow") or 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", 1.0):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def rope_attention_factor(args: ModelArgs) -> float:
    """What YaRN multiplies cos and sin by (1 for the other RoPE types)."""
    if args.rope_type != "yarn":
        return 1.0
    p = args.rope_params
    if p.get("attention_factor"):
        return p["attention_factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = p["factor"]
    if p.get("mscale") and p.get("mscale_all_dim"):
        return mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    """The RoPE table ``cos_sin [max_positions, rotary_dim]`` (cos | sin halves), float32, on the model's
    device; the ``Ops`` rotate queries and keys with it."""

    cos_sin: torch.Tensor  # a registered (non-persistent) buffer

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        self.args = args
        self.max_positions = max_positions
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        if self.cos_sin.device.type != "meta":  # on meta (the loader), computed once materialised
            self.reset_cache()

    def reset_cache(self) -> None:
        """(Re)compute the cache on the module's device (the loader calls it after ``to_empty``)."""
        device = self.cos_sin.device
        inv_freq = rope_inv_freq(self.args).to(device)
        freqs = torch.outer(torch.arange(self.max_positions, device=device, dtype=torch.float32), inv_freq)
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, D]
        factor = rope_attention_factor(self.args)
        if factor != 1.0:
            self.cos_sin *= factor



class Attention(nn.Module):
    def __init__(self, args: ModelArgs, rotary: RotaryEmbedding, backend: AttentionBackend, ops: Ops,
                 shard: ShardSizes, tp: TensorParallel, layer: int = 0) -> None:
        super().__init__()
        self.window = args.window(layer)
        # An FP8 KV cache's scales for this layer's K and V (the runner sets them; 1.0 by default).
        self.kv_scale: tuple[float, float] = (1.0, 1.0)
        # gpt-oss: this rank's heads' sink logits (float32 whatever the model dtype: the kernels read them so)
        self.sinks: nn.Parameter | None = None
        if args.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(shard.num_heads))
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, args.head_dim
        self.rotary_dim = args.rotary_dim
        self.q_size, self.kv_size = shard.num_heads * args.head_dim, shard.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, args.hidden_size, args.o_bias, tp)
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps, ops)
        else:
            self.q_norm = self.k_norm = None
        # Shared, not owned: registering them as submodules would duplicate them per layer.
        self._rotary = (rotary,)
        self._backend = backend
        self._ops = ops

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # x: [T, hidden]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        cos_sin = self._rotary[0].cos_sin
        partial = self.rotary_dim < self.head_dim
        # Per-head RMSNorm over rows of head_dim (reshape packs the rows); q_norm and k_norm are set together.
        fused = None
        if self.q_norm is not None and self.k_norm is not None:
            if isinstance(self._ops, NativeOps) and not partial:
                fused = self._ops.norm_rotary(q, k, (self.q_norm, self.k_norm), positions, cos_sin)
            if fused is None:
                head_dim = self.head_dim
                q = self.q_norm(q.reshape(-1, head_dim)).view(num_tokens, self.num_heads, head_dim)
                k = self.k_norm(k.reshape(-1, head_dim)).view(num_tokens, self.num_kv_heads, head_dim)
        if partial:  # GLM: only the first rotary_dim dimensions of each head turn
            rd = self.rotary_dim
            q_rot, k_rot = TorchOps.rotary(q[..., :rd], k[..., :rd], positions, cos_sin)
            q, k = torch.cat([q_rot, q[..., rd:]], dim=-1), torch.cat([k_rot, k[..., rd:]], dim=-1)
        else:
            q, k = self._ops.rotary(q, k, positions, cos_sin) if fused is None else fused
        sinks = None if self.sinks is None else self.sinks.float()
        out = self._backend.forward(q, k, v, kv_cache, meta, window=self.window, sinks=sinks,
                                    kv_scale=self.kv_scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """The gated MLP with this rank's ``intermediate`` columns; ``down_proj`` all-reduces over ``tp``."""

    def __init__(self, hidden_size: int, intermediate: int, bias: bool, ops: Ops, tp: TensorParallel) -> None:
        super().__init__()
        self._ops = ops
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._ops.silu_and_mul(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, D]


def feed_forward(args: ModelArgs, layer: int, ops: Ops, shard: ShardSizes, tp: TensorParallel,
                 fused_kernels: bool) -> nn.Module:
    """Layer ``layer``'s feed-forward: the dense MLP, or for a mixture of experts (``args.moe``) the
    ``MoE`` block on its sparse layers (with its shared expert, if any)."""
    moe = args.moe
    if moe is None or not moe.is_sparse(layer):
        return MLP(args.hidden_size, shard.intermediate_size, args.mlp_bias, ops, tp)
    from engine.models.moe import MoE

    shared = None
    if moe.shared_intermediate_size:
        # No all-reduce of its own: the MoE block reduces the experts' and the shared expert's sum once.
        shared = MLP(args.hidden_size, shard.shared_intermediate_size, False, ops, TensorParallel())
    return MoE(moe, args.hidden_size, shard, tp, use_kernel=fused_kernels, shared_experts=shared,
               fp8=args.fp8)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, rotary: RotaryEmbedding, backend: AttentionBackend, ops: Ops,
                 shard: ShardSizes, tp: TensorParallel, mlp: nn.Module, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.self_attn = Attention(args, rotary, backend, ops, shard, tp, layer)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` is the previous layer's output, ``residual`` the stream before it (None for layer 0); the
        residual add is fused into the next norm. Returns ``(mlp output, residual stream)``."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, backend: AttentionBackend, max_positions: int, ops: Ops,
                 shard: ShardSizes, tp: TensorParallel, fused_kernels: bool = False) -> None:
        super().__init__()
        # The loader fills every weight from the checkpoint, so the random init is skipped: under its
        # meta-device mode, Embedding's normal_ imports torch._dynamo (~2 s of CPU on the first load).
        self.embed_tokens = VocabParallelEmbedding(shard, args.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(args, max_positions)
        self.layers = nn.ModuleList(
            DecoderLayer(args, self.rotary_emb, backend, ops, shard, tp,
                         feed_forward(args, i, ops, shard, tp, fused_kernels), i)
            for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, kv_cache, meta)
        out, _ = self.norm(x, residual)
        return out


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``max_positions`` sizes the RoPE cache (at least the engine's max_model_len);
    ``fused_kernels`` picks ``TritonOps`` over ``NativeOps`` (``TorchOps`` with the CPU kernels); ``tp``:
    this process's rank of a tensor-parallel group (None: the whole model)."""

    def __init__(
        self,
        args: ModelArgs,
        backend: AttentionBackend,
        max_positions: int | None = None,
        fused_kernels: bool = False,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.args = args
        self.tp = tp = tp or TensorParallel()
        self.shard = shard = ShardSizes.of(args, tp.rank, tp.size, tp.expert_parallel)
        ops: Ops = TritonOps() if fused_kernels else NativeOps()
        self.model = LlamaModel(args, backend, max_positions or args.max_position_embeddings, ops, shard, tp,
                                fused_kernels)
        self.lm_head = nn.Linear(args.hidden_size, shard.vocab_per_rank, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head if the checkpoint ties them (again after ``to_empty``)."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the packed new tokens ``input_ids [T]`` at ``positions [T]``."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits [N, vocab] in the model dtype
        if not self.tp.enabled:
            return self.lm_head(hidden)
        return self.tp.gather_last_dim(self.lm_head(hidden))[:, : self.args.vocab_size]
