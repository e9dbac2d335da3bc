"""The shim's types: half and bfloat round to nearest even after every operation (compared bit
for bit with torch's float16/bfloat16, which do the same), float -> half/bfloat conversions, and
MSL vector construction, conversion and swizzles (kernels: tests/sim/kernels/lang_types.metal).
"""

import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

KERNELS = Path(__file__).parent / "kernels"
SRC = [KERNELS / "lang_types.metal"]


pytestmark = requires_clang

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


def run(name, **kw):
    from torch_steel import sim

    return sim.run_kernel(name, sources=SRC, **kw)


def assert_same_bits(got: torch.Tensor, expected: torch.Tensor):
    """Equal bit patterns, except that any NaN matches any NaN."""
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan)
    g = got[~nan].view(torch.int16)
    e = expected[~nan].view(torch.int16)
    bad = (g != e).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, first at {bad[0].item()}"


def operands(dtype, n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(n, generator=g) * 4).to(dtype)
    b = (torch.randn(n, generator=g) * 4).to(dtype)
    # Values whose products and sums land on rounding ties and on the format's edges.
    a[:6] = torch.tensor([1.0, 3.0, 255.0, 1e-3, -7.5, 1024.0]).to(dtype)
    b[:6] = torch.tensor([1.0 + 2**-7, 1.0 / 3, 257.0, 3e-3, 0.0, 64.0]).to(dtype)
    return a, b


@pytest.mark.parametrize("tname", ["f16", "bf16"])
def test_arithmetic_rounds_after_every_operation(tname):
    dtype = DTYPES[tname]
    a, b = operands(dtype)
    out = torch.zeros(a.numel() * 8, dtype=dtype)
    run(f"lang_arith_{tname}", grid=(a.numel() // 64,), threads=(64,), buffers={0: a, 1: b, 2: out})
    out = out.view(-1, 8)
    acc = a.clone()
    for _ in range(4):
        acc = acc * b + a
    # torch rounds each elementwise op's result to the tensor's dtype, as MSL does.
    expected = [a + b, a - b, a * b, a / b, a * b + a, (a + b) * (a - b), acc, -a * 3]
    for j, e in enumerate(expected):
        assert_same_bits(out[:, j], e)
    # The same chain kept in fp32 and rounded once differs: the test sees missing roundings.
    fused = a.float()
    for _ in range(4):
        fused = fused * b.float() + a.float()
    assert not torch.equal(fused.to(dtype), acc)


@pytest.mark.parametrize("tname", ["f16", "bf16"])
def test_float_to_narrow_conversion_is_round_to_nearest_even(tname):
    dtype = DTYPES[tname]
    mant = 10 if dtype == torch.float16 else 7
    ulp = 2.0**-mant
    specials = [
        1 + ulp / 2,  # tie: rounds down to the even 1.0
        1 + 3 * ulp / 2,  # tie: rounds up to the even 1 + 2 ulp
        1 + ulp / 2 + 2**-20,  # just above the tie: up
        -(1 + 3 * ulp / 2),
        65504.0,
        65520.0,  # half: overflows to inf
        3.0e38,
        1e-7,  # half subnormal
        6e-8,
        -0.0,
        float("inf"),
        float("-inf"),
        float("nan"),
    ]
    g = torch.Generator().manual_seed(1)
    a = torch.cat([torch.tensor(specials), torch.randn(128 - len(specials), generator=g) * 100])
    out = torch.zeros_like(a)
    narrow = torch.zeros(a.numel(), dtype=dtype)
    run(f"lang_convert_{tname}", grid=(2,), threads=(64,), buffers={0: a, 1: out, 2: narrow})
    assert_same_bits(narrow, a.to(dtype))
    assert torch.equal(out.nan_to_num(7.0), a.to(dtype).float().nan_to_num(7.0))


def test_vector_construction_conversion_and_swizzles():
    a = torch.tensor([1.25, -2.75, 3.0009765625, 100000.0])
    out = torch.full((64,), -999.0)
    iout = torch.full((10,), -999, dtype=torch.int32)
    run("lang_vectors", grid=(1,), threads=(1,), buffers={0: a, 1: out, 2: iout})
    x, y, z, w = a.tolist()
    h = a.half().float().tolist()  # half4(a): z rounds to 3.0, w overflows to inf
    expected = [
        1, 2, x, y,
        w, w, w,
        *h,
        *h,
        w, z, y, x,
        x, x, y, y,
        y, 7, w, 8,
        x, y, z, w,
        1, 2, 3, 4,
        0, 0,
        *a[:2].bfloat16().float().tolist(),
        1.5, 2.25,
        5, 6,
        z, 0.5, 0.25,
    ]  # fmt: skip
    assert h[2] == 3.0 and h[3] == float("inf")
    assert out[: len(expected)].tolist() == expected
    assert out[len(expected) :].eq(-999.0).all()
    x_bits = int(a[:1].view(torch.int32))
    h_bits = int(a[:2].half().view(torch.int32))
    assert iout.tolist() == [1, -2, 3, 100000, 1, -2, x_bits, h_bits, 3, 100000]


def round_exact(x: Fraction, bits: int, emin: int) -> Fraction:
    """x rounded to nearest even in a binary format with `bits` significant bits and smallest
    normal exponent emin (subnormals below it); no overflow handling (the cases stay in range)."""
    if x == 0:
        return x
    sign, a = (-1 if x < 0 else 1), abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    quantum = Fraction(2) ** (max(e, emin) - bits + 1)
    n = a / quantum
    q, r = divmod(n.numerator, n.denominator)
    if 2 * r > n.denominator or (2 * r == n.denominator and q % 2 == 1):
        q += 1
    return sign * q * quantum


FMA_FORMATS = {"f16": (11, -14), "bf16": (8, -126)}
# Cases where rounding to binary32 first (fmaf) and then to T differs from rounding once.
FMA_TIES = {
    "f16": [(-54.75, -1088.0, -0.0004341602325439453), (1.5, 35040.0, 0.0018100738525390625)],
    "bf16": [
        (0.140625, 4.299870835974154e33, 6.8833827526759706e-15),
        (-10200547328.0, 34.0, 6.9375),
    ],
}


@pytest.mark.parametrize("tname", ["f16", "bf16"])
def test_fma_rounds_once(tname):
    """MSL's fma is the correctly rounded a * b + c; the reference rounds the exact rational."""
    dtype = DTYPES[tname]
    bits, emin = FMA_FORMATS[tname]
    g = torch.Generator().manual_seed(3)
    n = 256
    a, b, c = ((torch.randn(n, generator=g) * 8).to(dtype) for _ in range(3))
    for k, (x, y, z) in enumerate(FMA_TIES[tname]):
        a[k], b[k], c[k] = x, y, z
    out = torch.zeros(n, dtype=dtype)
    run(f"lang_fma_{tname}", grid=(n // 64,), threads=(64,), buffers={0: a, 1: b, 2: c, 3: out})
    exact = [
        Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
        for x, y, z in zip(a.tolist(), b.tolist(), c.tolist(), strict=True)
    ]
    expected = torch.tensor([float(round_exact(e, bits, emin)) for e in exact]).to(dtype)
    twice = [float(round_exact(round_exact(e, 24, -126), bits, emin)) for e in exact]
    for k in range(len(FMA_TIES[tname])):
        assert twice[k] != float(expected[k])  # the cases do tell the two roundings apart
    assert_same_bits(out, expected)


def test_math_constants():
    """MSL tables 6.5-6.7: the float, half and bfloat constants, each the format's rounding."""
    out = torch.zeros(15)
    run("lang_constants", grid=(1,), threads=(1,), buffers={0: out})
    inf = float("inf")
    pi, ln2, e = math.pi, math.log(2), math.e

    def r(x, dtype):
        return torch.tensor(x, dtype=torch.float64).to(dtype).item()

    expected = [
        inf, -inf, None, torch.finfo(torch.float32).max, inf, r(pi, torch.float32),
        r(math.sqrt(0.5), torch.float32),
        torch.finfo(torch.float16).max, inf, r(pi, torch.float16), r(ln2, torch.float16),
        torch.finfo(torch.bfloat16).max, inf, r(pi, torch.bfloat16), r(e, torch.bfloat16),
    ]  # fmt: skip
    got = out.tolist()
    assert math.isnan(got[2])
    assert [g for k, g in enumerate(got) if k != 2] == [x for x in expected if x is not None]
