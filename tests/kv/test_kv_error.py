"""The quantization error of attention over a quantized KV cache, bounded loosely from each
format's step: torch_steel.sdpa over QuantizedKV keys and values against float64 attention
(PyTorch's F.scaled_dot_product_attention) over the unquantized fp16 cache.

The bound, per output element, for one query row q (scale c), keys k_j and values v_j, with
s_j = c q.k_j, p = softmax(s), o = sum_j p_j v_j. The quantized cache holds k_j + a_j and
v_j + b_j with |a_je| <= dK_je and |b_je| <= dV_je, the round-trip bound of the format
(test_kv_formats.py; computed below from the unquantized values, not from the module):
  int8 (symmetric, per group)   d = max|x| / 127 * (1/2 + 128 u)       ~ max|x| / 254
  4-bit (asymmetric, per group) d = (max x - min x) / 15 * (1/2 + 16 u) + 2 |min x| u
(u: half an ulp of the scales' dtype). Then
  |s^_j - s_j| = c |q.a_j| <= D := max_j c sum_e |q_e| dK_je,
  p^_j / p_j = e^(s^_j - s_j) / sum_i p_i e^(s^_i - s_i) lies in [e^-2D, e^2D],
      so |p^_j - p_j| <= (e^2D - 1) p_j;
  o^ - o = sum_j (p^_j - p_j)(v_j - o) + sum_j p^_j b_j    (sum_j (p^_j - p_j) = 0)
  |o^_e - o_e| <= (e^2D - 1) sum_j p_j |v_je - o_e|  +  min(e^2D sum_j p_j dV_je, max_j dV_je).
                   K term                                V term
(the V term's first form as p^_j <= e^2D p_j). Both terms are worst cases and hold for any
data. The K term assumes that a key's rounding errors align with the query's signs across the
whole head dim, and that the softmax's changes align with the values' deviations across the
keys; on random data they cancel instead: here the whole bound is 16-19x the error for int8
and ~1000x for 4-bit (D reaches 2, e^2D - 1 = 50) at the element where it is closest. The V term
alone comes within 1.1-1.3x of its error (a convex combination of errors up to dV), so it is
the part that a wrong dequantization or a coarser format must break: test_v_bound_is_not_vacuous
checks that they do, against attention over the same quantized keys (dequantized in float64
here, not by torch_steel.kv) and the unquantized values.
On top comes the op's own arithmetic: it dequantizes into the query's dtype and computes the
fp16 path's math, which tests/kv/test_kv_attention.py holds to TOL against float64 over the
same dequantized cache.
"""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torch_steel
from torch_steel import kv
from torch_steel.kv import QuantizedKV

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "attn"))
from attn_helpers import requires_simulator, strict  # noqa: E402

FORMATS = list(kv.FORMATS)
# The fp16 path's tolerance (test_kv_attention.py): the query dtype's rounding of each
# dequantized K/V value and of P, float32 accumulation.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}
ULP = {torch.float16: 2.0**-11, torch.float32: 2.0**-24}  # half an ulp of a stored scale
B, HQ, HKV, L, S, E = 2, 8, 2, 4, 65, 128  # GQA, S % 32 = 1, E fits every group


def _x(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _cache(seed, S=S):
    """The unquantized fp16 cache, with an outlier in one key's and one value's group."""
    x = _x(B, HKV, S, E, seed=seed) * 2
    x[0, 1, 3, 7] = 12
    return x.half()


def step_bound(x, format, scale_dtype):
    """The largest |x - dequantize(quantize(x))| of each value of x [..., E], in float64."""
    bits, group = kv.FORMATS[format]
    G = group or x.shape[-1]
    g = x.double().reshape(*x.shape[:-1], x.shape[-1] // G, G)
    u = ULP[scale_dtype]
    if bits == 8:
        d = g.abs().amax(-1, keepdim=True) / 127 * (0.5 + 128 * u)
    else:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        d = (hi - lo) / 15 * (0.5 + 16 * u) + 2 * lo.abs() * u
    return d.expand(g.shape).reshape(x.shape)


def dequantize64(x):
    """A QuantizedKV in float64, written out here: codes (nibbles low then high) * s (+ m)."""
    bits, group = kv.FORMATS[x.format]
    if bits == 8:
        codes = x.data.double()
    else:
        d = x.data.to(torch.int32)
        codes = torch.stack((d % 16, d // 16), -1).flatten(-2).double()
    G = group or codes.shape[-1]
    g = codes.reshape(*codes.shape[:-1], -1, G) * x.scales.double()[..., None]
    if x.mins is not None:
        g = g + x.mins.double()[..., None]
    return g.reshape(codes.shape)


def attention64(q, k, v):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)


def bounds(q, k, v, dK, dV):
    """(K term, V term) of the bound for each output element [B, Hq, L, E] (see the top)."""
    rep = q.shape[1] // k.shape[1]
    k, v, dK, dV = (t.double().repeat_interleave(rep, 1) for t in (k, v, dK, dV))
    c = 1 / math.sqrt(q.shape[-1])
    p = (q.double() @ k.mT * c).softmax(-1)  # [B, HQ, L, S]
    o = p @ v
    D = (c * q.double().abs() @ dK.mT).amax(-1, keepdim=True)  # [B, HQ, L, 1]
    spread = (p[..., None] * (v[:, :, None] - o[:, :, :, None]).abs()).sum(-2)
    v_term = torch.minimum(torch.exp(2 * D) * (p @ dV), dV.amax(-2, keepdim=True))
    return torch.expm1(2 * D) * spread, v_term


def arithmetic(want, dtype):
    return TOL[dtype] * (1 + want.abs())


@pytest.fixture(autouse=True)
def _reference():
    with torch_steel.backend("reference"):
        yield


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32))
def test_error_within_bound(format, dtype):
    """Every format on K and V (and another one on V): |sdpa(q, K^, V^) - attention(q, K, V)|
    <= K term + V term + the fp16 path's tolerance, elementwise; scales fp16 and fp32."""
    q = _x(B, HQ, L, E, seed=1).to(dtype)
    k, v = _cache(2), _cache(3)
    other = "q4_g32" if format.startswith("int8") else "int8_g64"
    want = attention64(q, k, v)
    for vf, ks, vs in ((format, torch.float16, torch.float32),
                       (other, torch.float32, torch.float16)):  # fmt: skip
        kq, vq = kv.quantize(k, format, ks), kv.quantize(v, vf, vs)
        got = torch_steel.sdpa(q, kq, vq, enable_gqa=True).double()
        kb, vb = bounds(q, k, v, step_bound(k, format, ks), step_bound(v, vf, vs))
        err = (got - want).abs()
        assert (err <= kb + vb + arithmetic(want, dtype)).all(), (err - kb - vb).max()
        assert err.max() > 0  # the cache was quantized


def _v_error(q, k, v, vq, dtype, backend="reference"):
    """|sdpa(q, K^, V^) - attention(q, K^, V)|, whose bound is the V term, K^ being the same
    quantized keys on both sides (dequantized in float64 here for the oracle)."""
    kq = kv.quantize(k, "int8_g32")
    with strict(), torch_steel.backend(backend):
        got = torch_steel.sdpa(q, kq, vq, enable_gqa=True).double()
    want = attention64(q, dequantize64(kq), v)
    return (got - want).abs(), want


def _wrong(x):
    """x dequantizing one step off: 4-bit mins raised by a step (a loader adding the scale
    once too often), int8 codes raised by one (an off-by-one zero point)."""
    if x.mins is not None:
        return QuantizedKV(x.data, x.scales, x.mins + x.scales, x.format)
    return QuantizedKV((x.data.clamp(max=126) + 1), x.scales, None, x.format)


def _v_bound(q, k, v, format):
    """The V term alone: the keys are the same on both sides (dK = 0, D = 0)."""
    zero = torch.zeros_like(k, dtype=torch.float64)
    return bounds(q, k, v, zero, step_bound(v, format, torch.float16))[1]


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dtype", (torch.float16, torch.float32))
def test_v_bound_is_not_vacuous(format, dtype):
    """The V term holds for each format, and breaks when V dequantizes one step off, or when
    the values are quantized by a 4-bit format of the same or a smaller group (for 4-bit: its
    error is outside the bound of int8 of that group)."""
    q = _x(B, HQ, L, E, seed=4).to(dtype)
    k, v = _cache(5), _cache(6)
    vq = kv.quantize(v, format)
    vb = _v_bound(q, k, v, format)
    for wrong in (False, True):
        err, want = _v_error(q, k, v, _wrong(vq) if wrong else vq, dtype)
        within = err <= vb + arithmetic(want, dtype)
        assert within.all() != wrong, (format, wrong, (err / vb).max())
    bits, group = kv.FORMATS[format]
    if bits == 8:  # int8 of a row or of 128 values against q4_g64, the coarsest 4-bit format
        coarse, fine = f"q4_g{min(group or 64, 64)}", format
    else:
        coarse, fine = format, f"int8_g{group}"
    err, want = _v_error(q, k, v, kv.quantize(v, coarse), dtype)
    assert not (err <= _v_bound(q, k, v, fine) + arithmetic(want, dtype)).all()


@requires_simulator
def test_decode_kernel_error_within_bound():
    """One decode step of the kernel in the simulator (checkers on, strict): fp16 queries, int8
    keys and 4-bit values; the whole bound and the V term hold, and V one step off breaks the
    V term as on the reference backend."""
    q = _x(B, HQ, 1, E, seed=7).half()
    k, v = _cache(8, S=33), _cache(9, S=33)
    kq, vq = kv.quantize(k, "int8_g32"), kv.quantize(v, "q4_g32")
    with strict(), torch_steel.backend("sim"):
        got = torch_steel.sdpa(q, kq, vq, enable_gqa=True).double()
    want = attention64(q, k, v)
    kb, vb = bounds(q, k, v, step_bound(k, "int8_g32", torch.float16),
                    step_bound(v, "q4_g32", torch.float16))  # fmt: skip
    assert ((got - want).abs() <= kb + vb + arithmetic(want, torch.float16)).all()
    vb = _v_bound(q, k, v, "q4_g32")
    for wrong in (False, True):
        err, want = _v_error(q, k, v, _wrong(vq) if wrong else vq, torch.float16, "sim")
        assert (err <= vb + arithmetic(want, torch.float16)).all() != wrong
