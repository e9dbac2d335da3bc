"""PyTorch's own Metal attention kernels as a standing corpus (issue 14, deliverable 2).

The prefill kernel (PrefillAttention.h) and the one-pass and two-pass decode kernels
(DecodeAttention.h) that the installed torch wheel ships under torch/include, with the c10/metal/
headers they include, are compiled unmodified (tests/sim/kernels/pytorch_*.metal only include
them, as PyTorch's Attention.metal does) and run with the arguments PyTorch's host code
(aten/src/ATen/native/mps/operations/Attention.mm) binds, checkers on, against float64 math.

The bindings and the host's dispatch rules live in bench/pytorch_mps.py (shared with
bench/bench_attention.py --predict); its docstring restates them.
"""

import sys
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel.errors import SimulatorError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import pytorch_mps  # noqa: E402

pytestmark = [
    requires_clang,
    pytest.mark.slow,
    pytest.mark.skipif(
        not pytorch_mps.available(), reason="this torch wheel ships no MPS attention kernels"
    ),
]

_METAL_NAMES = pytorch_mps.METAL_NAMES
_PREFILL_NAMES = pytorch_mps.PREFILL_NAMES
# Unit roundoff of the storage types (a value stored is within this relative error).
_EPS = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _launch(launch):
    pytorch_mps.run(launch, checkers=True)


def _reference(q, k, v, scale, causal=False, mask=None):
    """float64 attention with PyTorch's conventions: upper-left causal, grouped heads, an
    additive or boolean mask, and rows that see no key give 0 (as these kernels do)."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


def _check(out, ref, v, dtype, factor):
    """Within `factor` storage roundoffs of the largest |V| (the output is a convex combination
    of V rows, rounded to the storage type, from scores rounded on the way)."""
    bound = factor * _EPS[dtype] * float(v.double().abs().max())
    err = float((out.double() - ref).abs().max())
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


def _inputs(B, H, Hkv, qL, kL, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, qL, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, kL, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, kL, D, generator=g).to(dtype)
    return q, k, v, g


PREFILL_CASES = [
    # dtype, D, B, H, Hkv, qL, kL, causal, mask
    (torch.float32, 64, 1, 2, 1, 40, 45, False, None),
    (torch.float16, 64, 2, 2, 2, 33, 70, True, None),
    (torch.bfloat16, 128, 1, 2, 1, 20, 37, False, "bool"),
    (torch.float16, 32, 1, 1, 1, 17, 40, False, "additive"),
    (torch.float32, 256, 1, 1, 1, 16, 9, True, "bool"),
]


@pytest.mark.parametrize(
    "dtype,D,B,H,Hkv,qL,kL,causal,mask",
    PREFILL_CASES,
    ids=[
        f"{_PREFILL_NAMES[c[0]]}-d{c[1]}-{'causal' if c[7] else 'full'}-{c[8]}"
        for c in PREFILL_CASES
    ],
)
def test_prefill_attention(dtype, D, B, H, Hkv, qL, kL, causal, mask):
    q, k, v, g = _inputs(B, H, Hkv, qL, kL, D, dtype, seed=D + qL)
    m = None
    if mask == "bool":
        m = torch.rand(B, H, qL, kL, generator=g) > 0.3
        m[..., 0] = True  # every row sees a key
    elif mask == "additive":
        m = (torch.randn(B, 1, qL, kL, generator=g) * 2).to(dtype).expand(B, H, qL, kL)
    out = torch.full((B, H, qL, D), float("nan"), dtype=dtype)
    scale = 1.0 / D**0.5
    assert pytorch_mps.choose(qL, kL, D, D, dtype, causal, m) == "prefill"
    _launch(pytorch_mps.prefill_launch(q, k, v, out, scale, causal, m))
    ref = _reference(q, k, v, scale, causal, m)
    # Q is scaled (by scale * log2 e) and stored in the input type before the products.
    _check(out, ref, v, dtype, factor=8 if dtype == torch.float32 else 4)


def _decode_mask(kind, B, qL, kL, dtype, g):
    if kind == "bool":
        m = torch.rand(B, 1, qL, kL, generator=g) > 0.4
        m[..., 0] = True
        return m
    if kind == "additive":
        return (torch.randn(1, 1, qL, kL, generator=g) * 2).to(dtype)
    return None


DECODE_CASES = [
    # dtype, D, B, H, Hkv, qL, kL, causal, mask
    (torch.float32, 64, 1, 2, 1, 1, 50, False, None),
    (torch.float16, 128, 2, 2, 2, 3, 40, True, None),
    (torch.bfloat16, 64, 1, 2, 2, 4, 33, False, "bool"),
    (torch.float16, 96, 1, 1, 1, 2, 64, False, "additive"),
]


@pytest.mark.parametrize(
    "dtype,D,B,H,Hkv,qL,kL,causal,mask",
    DECODE_CASES,
    ids=[
        f"{_METAL_NAMES[c[0]]}-d{c[1]}-{'causal' if c[7] else 'full'}-{c[8]}" for c in DECODE_CASES
    ],
)
def test_decode_one_pass(dtype, D, B, H, Hkv, qL, kL, causal, mask):
    q, k, v, g = _inputs(B, H, Hkv, qL, kL, D, dtype, seed=D + kL)
    m = _decode_mask(mask, B, qL, kL, dtype, g)
    out = torch.full((B, H, qL, D), float("nan"), dtype=dtype)
    scale = 1.0 / D**0.5
    assert pytorch_mps.choose(qL, kL, D, D, dtype, causal, m) == "vector"
    _launch(pytorch_mps.vector_launch(q, k, v, out, scale, causal, m))
    ref = _reference(q, k, v, scale, causal, None if m is None else m.expand(B, H, qL, kL))
    _check(out, ref, v, dtype, factor=8 if dtype == torch.float32 else 2)


TWO_PASS_CASES = [
    (torch.float32, 64, 1, 2, 1, 2, 1030, False, None),
    (torch.float16, 128, 1, 2, 2, 1, 1100, True, None),
    (torch.bfloat16, 64, 1, 1, 1, 3, 1024, False, "bool"),
]


@pytest.mark.parametrize(
    "dtype,D,B,H,Hkv,qL,kL,causal,mask",
    TWO_PASS_CASES,
    ids=[
        f"{_METAL_NAMES[c[0]]}-d{c[1]}-{'causal' if c[7] else 'full'}-{c[8]}"
        for c in TWO_PASS_CASES
    ],
)
def test_decode_two_pass(dtype, D, B, H, Hkv, qL, kL, causal, mask):
    q, k, v, g = _inputs(B, H, Hkv, qL, kL, D, dtype, seed=D + kL)
    m = _decode_mask(mask, B, qL, kL, dtype, g)
    out = torch.full((B, H, qL, D), float("nan"), dtype=dtype)
    scale = 1.0 / D**0.5
    assert pytorch_mps.choose(qL, kL, D, D, dtype, causal, m) == "vector_2pass"
    pass1, pass2 = pytorch_mps.vector_2pass_launches(q, k, v, out, scale, causal, m)
    # PyTorch defect (from MLX's kernel): pass 1 stores its block's sum and maximum with
    # `if (simd_gid == 0) { sums[0] = ...; maxs[0] = ...; }`, all 32 lanes of simdgroup 0
    # writing the same float to one address with nothing ordering them: a data race, undefined
    # in MSL's memory model (harmless on today's GPUs, where the lanes store the same value in
    # one instruction; `simd_lid == 0` too would fix it). The checkers report it ...
    race = r"data race on device memory \(byte offset 0 of \[\[buffer\(4\)\]\]\): thread 0 "
    with pytest.raises(SimulatorError, match=race):
        pytorch_mps.run(pass1, checkers=True)
    # ... and without them (on the bytes the race leaves, the same from every lane) the numbers
    # are checked; pass 2 runs with the checkers on.
    pytorch_mps.run(pass1, checkers=False)
    _launch(pass2)
    ref = _reference(q, k, v, scale, causal, None if m is None else m.expand(B, H, qL, kL))
    # The partials are stored in the input type between the passes: one more rounding.
    _check(out, ref, v, dtype, factor=8 if dtype == torch.float32 else 3)
