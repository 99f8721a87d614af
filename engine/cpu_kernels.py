"""Fused float32 CPU kernels in C, built on first use with the system C compiler and called through ctypes.

On one CPU core the engine's small model spends most of its non-GEMM time in memory traffic and in
per-op overhead; these kernels do in one pass what PyTorch does in several:

- ``paged_decode``: decode attention straight from the block-shaped KV cache. The torch backend's
  SDPA path gathers every sequence's K/V blocks into a contiguous copy, then reads the copy: the cache
  is read twice and the copy written once. Here each block of a sequence is read once per pass (scores,
  then values), the next block prefetched, and the query heads of a KV head share every load (GQA
  without a repeat).
- ``rms_norm`` (residual add fused in), ``silu_and_mul``, ``rotary`` (rotate-half RoPE of q and k into
  contiguous outputs, with Qwen3's per-head q/k RMSNorm fused in front): ``engine.models.llama.NativeOps``.
- ``draw_by_inversion``: the sampler's unseeded, unfiltered draw (softmax, cumulative sum and search in
  one pass per row).

Invariants:

- Optional: ``library()`` returns ``None`` (callers keep their PyTorch paths) when there is no C
  compiler, the build fails, or ``TOLLGATE_NATIVE_KERNELS=0``. Nothing in the engine requires it.
- Float32, contiguous last dimensions; ``paged_decode`` needs ``head_dim % 8 == 0``, ``head_dim <=
  256`` and at most 16 query heads per KV head (``decode_supported``). Wrappers check shapes they rely on.
- The same math as the PyTorch ops, in float32; only the summation order (vectorised by 8) and fused
  multiply-adds differ, at the level of rounding. ``exp`` is a range-reduced degree-7 polynomial
  accurate to a few ulp.
- The shared library is cached under ``$XDG_CACHE_HOME/tollgate`` (else the temp dir), named by a hash
  of the source and the compiler flags; concurrent builders race harmlessly (atomic rename).
- Single-threaded; ctypes releases the GIL during a call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAX_HEAD_DIM = 256
MAX_GROUP = 16

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef float vf __attribute__((vector_size(32)));
typedef float vf_u __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi __attribute__((vector_size(32)));
#define W 8
#define MAX_D 256
#define MAX_G 16

static inline vf load(const float *p) { return *(const vf_u *)p; }
static inline void store(float *p, vf v) { *(vf_u *)p = v; }
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }

static inline float hsum(vf v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

static inline vf clamp(vf x, float lo, float hi) {
    const vf l = splat(lo), h = splat(hi);
    vi below = x < l, above = x > h;
    x = (vf)(((vi)l & below) | ((vi)x & ~below));
    return (vf)(((vi)h & above) | ((vi)x & ~above));
}

/* exp(x), x clamped to [-87, 88] (exp(-87) ~ 1.6e-38 stands for 0, exp(88) ~ 1.7e38 for overflow):
   x = k ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-7 Taylor polynomial (the truncation error,
   r^8 / 8!, is below float precision), times 2^k built in the exponent bits. */
static inline vf vexp(vf x) {
    x = clamp(x, -87.0f, 88.0f);
    const vf round = splat(12582912.0f);  /* 1.5 * 2^23: adding and subtracting it rounds to integer */
    vf k = (x * splat(1.44269504088896341f) + round) - round;
    vf r = x - k * splat(0.693359375f) - k * splat(-2.12194440e-4f);
    vf p = splat(1.0f / 5040.0f);
    p = p * r + splat(1.0f / 720.0f);
    p = p * r + splat(1.0f / 120.0f);
    p = p * r + splat(1.0f / 24.0f);
    p = p * r + splat(1.0f / 6.0f);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    vi bits = (__builtin_convertvector(k, vi) + 127) << 23;
    return p * (vf)bits;
}

/* Softmax numerators of scores[0:n] in place; returns their sum. */
static float exp_shifted(float *s, int64_t n) {
    float m = -INFINITY;
    for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
    vf acc = splat(0.0f);
    int64_t t = 0;
    for (; t + W <= n; t += W) {
        vf e = vexp(load(s + t) - splat(m));
        store(s + t, e);
        acc += e;
    }
    float sum = hsum(acc);
    for (; t < n; t++) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    return sum;
}

/* The 8 horizontal sums of d[0..7], as one vector (a transposing reduction tree). */
static inline vf reduce8(const vf *d) {
    const vi lo1 = {0, 8, 2, 10, 4, 12, 6, 14}, hi1 = {1, 9, 3, 11, 5, 13, 7, 15};
    const vi lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const vi lo3 = {0, 1, 2, 3, 8, 9, 10, 11}, hi3 = {4, 5, 6, 7, 12, 13, 14, 15};
    vf s01 = __builtin_shuffle(d[0], d[1], lo1) + __builtin_shuffle(d[0], d[1], hi1);
    vf s23 = __builtin_shuffle(d[2], d[3], lo1) + __builtin_shuffle(d[2], d[3], hi1);
    vf s45 = __builtin_shuffle(d[4], d[5], lo1) + __builtin_shuffle(d[4], d[5], hi1);
    vf s67 = __builtin_shuffle(d[6], d[7], lo1) + __builtin_shuffle(d[6], d[7], hi1);
    vf s0123 = __builtin_shuffle(s01, s23, lo2) + __builtin_shuffle(s01, s23, hi2);
    vf s4567 = __builtin_shuffle(s45, s67, lo2) + __builtin_shuffle(s45, s67, hi2);
    return __builtin_shuffle(s0123, s4567, lo3) + __builtin_shuffle(s0123, s4567, hi3);
}

/* Lane-wise partial products of one query head (DV vectors) with the key at kp: hsum gives the dot. */
static inline vf key_dot(const vf *qh, const float *kp, int64_t DV) {
    vf d = qh[0] * load(kp);
    for (int64_t j = 1; j < DV; j++) d += qh[j] * load(kp + j * W);
    return d;
}

static inline void prefetch_block(const float *p, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(p + i);
}

/* One new token per sequence b in [0, n): out[row] = softmax(q[row] K^T * scale) V over the first
   seq_lens[b] positions of its paged K/V. q, out: [T, H, D] rows (row = rows[b], or b without rows);
   caches: [num_blocks, BS, KVH, D]; tables: [n, table_stride] int32. Two passes over a sequence's
   blocks, each reading a block (all KV heads) while the next one is prefetched: scores of every query
   head, then the weighted values. Returns 0, or -1 if out of memory. */
int tg_paged_decode_f32(const float *q, float *out, const int64_t *rows, const float *k_cache,
                        const float *v_cache, const int32_t *tables, int64_t table_stride,
                        const int32_t *seq_lens, int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                        float scale, int64_t max_len) {
    const int64_t G = H / KVH, DV = D / W, token_stride = KVH * D, block_stride = BS * KVH * D;
    float *scores = malloc(sizeof(float) * (size_t)(H * (max_len > 0 ? max_len : 1)));
    vf *qv = aligned_alloc(sizeof(vf), sizeof(vf) * (size_t)(2 * H * DV));
    if (!scores || !qv) {
        free(scores);
        free(qv);
        return -1;
    }
    vf *acc = qv + H * DV;
    for (int64_t b = 0; b < n; b++) {
        const int64_t row = rows ? rows[b] : b, S = seq_lens[b], num_blocks = (S + BS - 1) / BS;
        const int32_t *table = tables + b * table_stride;
        for (int64_t h = 0; h < H; h++)
            for (int64_t j = 0; j < DV; j++)
                qv[h * DV + j] = load(q + row * H * D + h * D + j * W) * splat(scale);
        for (int64_t nb = 0; nb < num_blocks; nb++) {
            const float *kb = k_cache + (int64_t)table[nb] * block_stride;
            if (nb + 1 < num_blocks)
                prefetch_block(k_cache + (int64_t)table[nb + 1] * block_stride, block_stride);
            const int64_t t0 = nb * BS, end = S - t0 < BS ? S - t0 : BS;
            for (int64_t h = 0; h < H; h++) {
                const float *kh = kb + (h / G) * D;
                const vf *qh = qv + h * DV;
                float *sh = scores + h * S + t0;
                int64_t i = 0;
                for (; i + W <= end; i += W) {
                    vf dot[W];
                    for (int64_t u = 0; u < W; u++) dot[u] = key_dot(qh, kh + (i + u) * token_stride, DV);
                    store(sh + i, reduce8(dot));
                }
                for (; i < end; i++) sh[i] = hsum(key_dot(qh, kh + i * token_stride, DV));
            }
        }
        for (int64_t h = 0; h < H; h++) {
            const vf inv_sum = splat(1.0f / exp_shifted(scores + h * S, S));
            for (int64_t j = 0; j < DV; j++) acc[h * DV + j] = splat(0.0f);
            qv[h * DV] = inv_sum;  /* the queries are no longer needed */
        }
        for (int64_t nb = 0; nb < num_blocks; nb++) {
            const float *vb = v_cache + (int64_t)table[nb] * block_stride;
            if (nb + 1 < num_blocks)
                prefetch_block(v_cache + (int64_t)table[nb + 1] * block_stride, block_stride);
            const int64_t t0 = nb * BS, end = S - t0 < BS ? S - t0 : BS;
            for (int64_t h = 0; h < H; h++) {
                const float *vh = vb + (h / G) * D, *sh = scores + h * S + t0;
                vf a[MAX_D / W];
                for (int64_t j = 0; j < DV; j++) a[j] = acc[h * DV + j];
                for (int64_t i = 0; i < end; i++) {
                    const vf w = splat(sh[i]);
                    const float *vp = vh + i * token_stride;
                    for (int64_t j = 0; j < DV; j++) a[j] += w * load(vp + j * W);
                }
                for (int64_t j = 0; j < DV; j++) acc[h * DV + j] = a[j];
            }
        }
        for (int64_t h = 0; h < H; h++)
            for (int64_t j = 0; j < DV; j++)
                store(out + row * H * D + h * D + j * W, acc[h * DV + j] * qv[h * DV]);
    }
    free(scores);
    free(qv);
    return 0;
}

/* out = w * (s / sqrt(mean(s^2) + eps)) per row, s = x (+ residual, then written to residual_out). */
void tg_rms_norm_f32(const float *x, int64_t x_stride, const float *residual, float *residual_out,
                     float *out, const float *w, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        const float *src = xr;
        if (residual) {
            const float *res = residual + r * dim;
            float *sum = residual_out + r * dim;
            int64_t i = 0;
            for (; i + W <= dim; i += W) store(sum + i, load(xr + i) + load(res + i));
            for (; i < dim; i++) sum[i] = xr[i] + res[i];
            src = sum;
        }
        vf acc = splat(0.0f);
        float tail = 0.0f;
        int64_t i = 0;
        for (; i + W <= dim; i += W) {
            vf v = load(src + i);
            acc += v * v;
        }
        for (; i < dim; i++) tail += src[i] * src[i];
        const float inv = 1.0f / sqrtf((hsum(acc) + tail) / (float)dim + eps);
        float *o = out + r * dim;
        i = 0;
        for (; i + W <= dim; i += W) store(o + i, load(w + i) * (load(src + i) * splat(inv)));
        for (; i < dim; i++) o[i] = w[i] * (src[i] * inv);
    }
}

/* out[r] = silu(x[r, :I]) * x[r, I:], silu(g) = g / (1 + exp(-g)). */
void tg_silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * inter, *up = gate + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + W <= inter; i += W) {
            vf g = load(gate + i);
            store(o + i, g / (splat(1.0f) + vexp(-g)) * load(up + i));
        }
        for (; i < inter; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* Rotate-half RoPE of heads rows of D floats (token t's heads at x + t * x_stride, D apart) into
   out [T, heads, D]: out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin with cos | sin = cos_sin[pos].
   With norm_w, each head is first RMS-normalised (Qwen3's q_norm / k_norm, D <= 256). */
static void rotate(const float *x, int64_t x_stride, float *out, int64_t T, int64_t heads, int64_t D,
                   const int64_t *positions, const float *cos_sin, const float *norm_w, float eps) {
    const int64_t half = D / 2;
    float normed[256];
    for (int64_t t = 0; t < T; t++) {
        const float *cos = cos_sin + positions[t] * D, *sin = cos + half;
        for (int64_t h = 0; h < heads; h++) {
            const float *x1 = x + t * x_stride + h * D;
            if (norm_w) {
                tg_rms_norm_f32(x1, D, NULL, NULL, normed, norm_w, 1, D, eps);
                x1 = normed;
            }
            const float *x2 = x1 + half;
            float *o1 = out + (t * heads + h) * D, *o2 = o1 + half;
            int64_t i = 0;
            for (; i + W <= half; i += W) {
                vf a = load(x1 + i), b = load(x2 + i), c = load(cos + i), s = load(sin + i);
                store(o1 + i, a * c - b * s);
                store(o2 + i, b * c + a * s);
            }
            for (; i < half; i++) {
                o1[i] = x1[i] * cos[i] - x2[i] * sin[i];
                o2[i] = x2[i] * cos[i] + x1[i] * sin[i];
            }
        }
    }
}

void tg_rotary_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, float *q_out,
                   float *k_out, int64_t T, int64_t H, int64_t KVH, int64_t D, const int64_t *positions,
                   const float *cos_sin, const float *q_norm_w, const float *k_norm_w, float eps) {
    rotate(q, q_stride, q_out, T, H, D, positions, cos_sin, q_norm_w, eps);
    rotate(k, k_stride, k_out, T, KVH, D, positions, cos_sin, k_norm_w, eps);
}

/* Sampling by inversion: tokens[r] = the first i whose running sum of exp(x[r, :] - max) exceeds
   u[r] * total (u in [0, 1)); -inf logits weigh exactly 0 and are never chosen. */
void tg_draw_by_inversion_f32(const float *x, int64_t rows, int64_t V, const float *u, int64_t *tokens,
                              float *weights) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * V;
        float m = -INFINITY;
        for (int64_t i = 0; i < V; i++) m = xr[i] > m ? xr[i] : m;
        vf acc = splat(0.0f);
        float tail = 0.0f;
        int64_t i = 0;
        const vf neg_inf = splat(-INFINITY);
        for (; i + W <= V; i += W) {
            vf v = load(xr + i);
            vf e = (vf)((vi)vexp(v - splat(m)) & (v != neg_inf));
            store(weights + i, e);
            acc += e;
        }
        for (; i < V; i++) {
            weights[i] = xr[i] == -INFINITY ? 0.0f : expf(xr[i] - m);
            tail += weights[i];
        }
        const float target = u[r] * (hsum(acc) + tail);
        int64_t chosen = -1, last = 0;
        float running = 0.0f;
        for (i = 0; i < V; i++) {
            if (weights[i] > 0.0f) last = i;
            running += weights[i];
            if (running > target && weights[i] > 0.0f) {
                chosen = i;
                break;
            }
        }
        tokens[r] = chosen >= 0 ? chosen : last;  /* rounding left the running sum short of the target */
    }
}
"""


class Library:
    """The loaded kernels, with argument types set."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
        self.paged_decode = lib.tg_paged_decode_f32
        self.paged_decode.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, f32,
                                      i64]
        self.paged_decode.restype = ctypes.c_int
        self.rms_norm = lib.tg_rms_norm_f32
        self.rms_norm.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, f32]
        self.rms_norm.restype = None
        self.silu_and_mul = lib.tg_silu_and_mul_f32
        self.silu_and_mul.argtypes = [ptr, ptr, i64, i64]
        self.silu_and_mul.restype = None
        self.rotary = lib.tg_rotary_f32
        self.rotary.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, f32]
        self.rotary.restype = None
        self.draw_by_inversion = lib.tg_draw_by_inversion_f32
        self.draw_by_inversion.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
        self.draw_by_inversion.restype = None


_library: Library | None = None
_loaded = False


def _compiler_flags() -> list[str]:
    # -ffp-contract=fast: a * b + c as one fused multiply-add (ISO C modes turn contraction off).
    flags = ["-O3", "-shared", "-fPIC", "-std=c11", "-ffp-contract=fast"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]  # 8-wide vectors in one register, fused multiply-add
    return flags


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    for candidate in (Path(base) / "tollgate", Path(tempfile.gettempdir()) / f"tollgate-{os.getuid()}"):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            continue
    raise OSError("no writable cache directory for the native kernels")


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc, gcc) on PATH")
    flags = _compiler_flags()
    key = hashlib.sha256("\0".join([_SOURCE, compiler, *flags]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels_{key}.so"
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "cpu_kernels.c"
        source.write_text(_SOURCE, encoding="utf-8")
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, "-o", str(built), str(source), "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(built, target)  # atomic: a concurrent builder's copy is identical
    return target


def library() -> Library | None:
    """The compiled kernels (built and cached on the first call in a process), or None if unavailable."""
    global _library, _loaded
    if _loaded:
        return _library
    _loaded = True
    if os.environ.get("TOLLGATE_NATIVE_KERNELS", "1") == "0":
        return None
    try:
        _library = Library(ctypes.CDLL(str(_build())))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("native CPU kernels unavailable, the engine uses its PyTorch paths: %s", detail)
    return _library


def decode_supported(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether ``paged_decode`` handles this device, dtype and head geometry (``group``: query heads
    per KV head)."""
    return (device.type == "cpu" and dtype == torch.float32 and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM
            and group <= MAX_GROUP)


def paged_decode(
    lib: Library,
    q: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor | None,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> None:
    """Decode attention of ``len(seq_lens)`` one-token queries into their rows of ``out``.

    ``q``/``out``: contiguous ``[T, H, D]`` float32; ``rows``: int64 ``[n]`` token row of each sequence
    (None: rows ``0..n-1``); ``block_tables``: int32 ``[n, W]`` with a contiguous last dimension;
    ``seq_lens``: contiguous int32 ``[n]``, each ``<= max_len``; ``kv_cache``: contiguous ``[2, NB, BS,
    KVH, D]``."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    status = lib.paged_decode(q.data_ptr(), out.data_ptr(), None if rows is None else rows.data_ptr(),
                              kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_tables.data_ptr(),
                              block_tables.stride(0), seq_lens.data_ptr(), seq_lens.shape[0], num_heads,
                              num_kv_heads, head_dim, block_size, scale, max_len)
    if status != 0:
        raise MemoryError("paged decode: out of memory for the attention scores")


def _rows_ok(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1


def rms_norm(
    lib: Library, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """``TorchOps.rms_norm`` for 2-D float32 rows (``residual`` contiguous); None if it does not apply."""
    if not _rows_ok(x) or not weight.is_contiguous() or (residual is not None
                                                         and not residual.is_contiguous()):
        return None
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=x.dtype)
    summed = None if residual is None else torch.empty(rows, dim, dtype=x.dtype)
    lib.rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                 None if summed is None else summed.data_ptr(), out.data_ptr(), weight.data_ptr(), rows, dim,
                 eps)
    return out if summed is None else (out, summed)


def silu_and_mul(lib: Library, x: torch.Tensor) -> torch.Tensor | None:
    """``silu(x[:, :I]) * x[:, I:]`` for contiguous float32 ``[T, 2I]``; None if it does not apply."""
    if not _rows_ok(x) or not x.is_contiguous() or x.shape[1] % 2:
        return None
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, dtype=x.dtype)
    lib.silu_and_mul(x.data_ptr(), out.data_ptr(), rows, inter)
    return out


def rotary(
    lib: Library,
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``TorchOps.rotary`` into contiguous ``[T, H, D]`` / ``[T, KVH, D]``, after a per-head RMSNorm of q
    and k with ``norm_weights`` (q's, k's) if given; None if it does not apply (``q``/``k`` need heads
    packed ``D`` apart with a contiguous last dimension)."""
    if q.dtype != torch.float32 or k.dtype != torch.float32 or q.device.type != "cpu" \
            or cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous() \
            or positions.dtype != torch.int64 or not positions.is_contiguous():
        return None
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2 or q.stride()[1:] != (head_dim, 1) or k.stride()[1:] != (head_dim, 1):
        return None
    q_norm = k_norm = None
    if norm_weights is not None:
        q_norm, k_norm = norm_weights
        if head_dim > MAX_HEAD_DIM or not all(w.dtype == torch.float32 and w.is_contiguous()
                                              and w.shape == (head_dim,) for w in norm_weights):
            return None
    q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
    k_out = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=k.dtype)
    lib.rotary(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), q_out.data_ptr(), k_out.data_ptr(),
               num_tokens, num_heads, num_kv_heads, head_dim, positions.data_ptr(), cos_sin.data_ptr(),
               None if q_norm is None else q_norm.data_ptr(), None if k_norm is None else k_norm.data_ptr(),
               eps)
    return q_out, k_out


def draw_by_inversion(lib: Library, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
    """One token per row of float32 CPU ``logits [N, V]`` (already divided by the temperature), drawn
    from ``softmax(logits)`` by inversion with one uniform per row from ``generator``; None if it does
    not apply. One pass instead of softmax, cumsum and searchsorted."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2:
        return None
    logits = logits.contiguous()
    rows, vocab = logits.shape
    uniforms = torch.rand(rows, generator=generator)
    tokens = torch.empty(rows, dtype=torch.int64)
    weights = torch.empty(vocab, dtype=torch.float32)
    lib.draw_by_inversion(logits.data_ptr(), rows, vocab, uniforms.data_ptr(), tokens.data_ptr(),
                          weights.data_ptr())
    return tokens
