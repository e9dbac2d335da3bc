"""Values that must come out as on an Apple GPU, and conversions that MSL leaves undefined and
the simulator reports (kernels: tests/sim/kernels/lang_fidelity.metal)."""

import struct
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel import sim
from torch_steel.errors import SimulatorError

SRC = [Path(__file__).parent / "kernels" / "lang_fidelity.metal"]

pytestmark = requires_clang


def run(name, **kw):
    return sim.run_kernel(name, sources=SRC, **kw)


def test_vector_bool_converts_to_one():
    x = torch.tensor([1.0, -2.0, 0.0, 3.0])
    out = torch.zeros(20)
    iout = torch.zeros(4, dtype=torch.int32)
    run("lang_bool_vector_to_number", grid=(1,), threads=(1,), buffers={0: x, 1: out, 2: iout})
    assert out[0:4].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert out[4:8].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert iout.tolist() == [1, 0, 0, 1]
    assert out[8:12].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert out[12:16].tolist() == [-1.0] * 4
    assert out[16:20].tolist() == x.tolist()  # through half and its bits, all exact


def test_fract_of_half_stays_below_one():
    x = torch.tensor([-1e-4, -0.0, 1.5, -2.25, 65504.0, -1e-3], dtype=torch.float16)
    out = torch.zeros(6, dtype=torch.float16)
    run("lang_fract_half", grid=(1,), threads=(6,), buffers={0: x, 1: out})
    largest_below_one = float(torch.tensor(1.0, dtype=torch.float16) - 2**-11)
    expected = [largest_below_one, 0.0, 0.5, 0.75, 0.0, float(torch.tensor(1 - 1e-3).half())]
    assert out.float().tolist() == pytest.approx(expected, abs=0)
    assert (out < 1).all()


@pytest.mark.parametrize("which", [0, 1, 2, 3], ids=["int", "uint", "int4", "half-short"])
def test_float_to_int_out_of_range_or_nan_is_reported(which):
    fine = (
        torch.tensor([1.5, -2.5, 100.0, 0.0]) if which != 1 else torch.tensor([1.5, 2.0, 0.0, 7.9])
    )
    out = torch.zeros(4, dtype=torch.int32)
    run(
        "lang_float_to_int",
        grid=(1,),
        threads=(4,),
        buffers={0: fine, 1: out, 2: struct.pack("<I", which)},
    )
    assert out.tolist() == fine.trunc().int().tolist()
    bad = {0: 3e9, 1: -5.0, 2: float("nan"), 3: 40000.0}[which]
    with pytest.raises(
        SimulatorError, match=r"lang_float_to_int.*(cannot represent|undefined in MSL)"
    ):
        run(
            "lang_float_to_int",
            grid=(1,),
            threads=(4,),
            buffers={0: torch.tensor([1.0, bad, 2.0, 3.0]), 1: out, 2: struct.pack("<I", which)},
        )


def test_own_fast_overload_does_not_capture_float_calls():
    x = torch.tensor([0.1, 0.3, 1.7, -2.2])
    out = torch.zeros(4)
    hout = torch.zeros(4, dtype=torch.float16)
    run("lang_fast_overload", grid=(1,), threads=(4,), buffers={0: x, 1: out, 2: hout})
    assert torch.allclose(out.double(), torch.exp2(x.double()), rtol=1e-6, atol=0)
    assert torch.equal(hout, torch.exp2(x.half().float()).half())


def _precision_run(monkeypatch, mode, seed=0):
    if mode is None:
        monkeypatch.delenv("TORCH_STEEL_SIM_FAST_MATH", raising=False)
    else:
        monkeypatch.setenv("TORCH_STEEL_SIM_FAST_MATH", mode)
    monkeypatch.setenv("TORCH_STEEL_SIM_FAST_MATH_SEED", str(seed))
    x = torch.linspace(-3.0, 3.0, 64)
    out = torch.zeros(64 * 9)
    hout = torch.zeros(64 * 4, dtype=torch.float16)
    run("lang_precision", grid=(1,), threads=(64,), buffers={0: x, 1: out, 2: hout})
    return x.double(), out.view(64, 9).double(), hout.view(64, 4).double()


def _ulp(v, dtype):
    """The spacing of dtype's values at |v| (float64 in, float64 out)."""
    t = v.abs().to(dtype)
    return (torch.nextafter(t, torch.full_like(t, float("inf"))) - t).double()


def test_worst_precision_moves_results_to_the_edge_of_the_msl_bounds(monkeypatch):
    x, exact, hexact = _precision_run(monkeypatch, None)
    _, worst, hworst = _precision_run(monkeypatch, "worst")
    p = (x.float().abs() + 0.25).double()  # as the kernel computes it
    truth = torch.stack(
        [x.exp(), torch.exp2(x), p.log(), torch.log2(p), p.rsqrt(), x.sin(), x / 3.0], dim=1
    )
    in_half = (p >= 0.5) & (p <= 2.0)
    bounds = torch.stack(
        [
            (3 + (2 * x).abs().floor()) * _ulp(truth[:, 0], torch.float32),
            (3 + (2 * x).abs().floor()) * _ulp(truth[:, 1], torch.float32),
            torch.where(in_half, 2.0**-21, 3 * _ulp(truth[:, 2], torch.float32)),
            torch.where(in_half, 2.0**-22, 2 * _ulp(truth[:, 3], torch.float32)),
            2 * _ulp(truth[:, 4], torch.float32),
            torch.full_like(x, 2.0**-13),
            2.5 * _ulp(truth[:, 6], torch.float32),
        ],
        dim=1,
    )
    err = (worst[:, :7] - truth).abs()
    assert (err <= bounds).all(), (err / bounds).max()
    # At the edge: beyond what a correctly rounded result could be off (half an ulp of float),
    # for most results (a few are exact or sit where the bound and the rounding meet).
    moved = err > (exact[:, :7] - truth).abs() + 0.25 * bounds
    assert moved.float().mean() > 0.9
    # Not perturbed: precise float and the correctly rounded sqrt.
    assert torch.equal(worst[:, 7:], exact[:, 7:])
    # half exp, log, tanh: within 1 ulp of half from the binary32 result; moved to the
    # neighbour of the rounded result unless that neighbour is beyond the bound (then the
    # rounded result is already the farthest on its side: about half the time); sqrt correctly
    # rounded.
    hf = torch.stack(
        [x.half().double().exp(), p.half().double().log(), x.half().double().tanh()], 1
    )
    herr = (hworst[:, :3] - hf).abs()
    assert (herr <= _ulp(hf, torch.float16) * (1 + 2**-10)).all()
    assert (hworst[:, :3] != hexact[:, :3]).float().mean() > 0.3
    assert torch.equal(hworst[:, 3], hexact[:, 3])


def _composed_run(monkeypatch, mode):
    if mode is None:
        monkeypatch.delenv("TORCH_STEEL_SIM_FAST_MATH", raising=False)
    else:
        monkeypatch.setenv("TORCH_STEEL_SIM_FAST_MATH", mode)
    x = torch.linspace(-3.0, 3.0, 64)
    out = torch.zeros(64 * 18)
    hout = torch.zeros(64 * 4, dtype=torch.float16)
    run("lang_precision_composed", grid=(1,), threads=(64,), buffers={0: x, 1: out, 2: hout})
    return x.double(), out.view(64, 18).double(), hout.view(64, 4).double()


def _f32(v):
    """v rounded to float32 as the kernel holds it, back in float64."""
    return v.float().double()


def _bound_log(u):
    """Table 8.2's fast log bound at u > 0: 2^-21 absolute in [0.5, 2], else 3 ulp."""
    return torch.where((u >= 0.5) & (u <= 2.0), 2.0**-21, 3 * _ulp(u.log(), torch.float32))


def _bound_fast_sqrt(w):
    """sqrt(w) = w * rsqrt(w): rsqrt's 2 ulp scaled by w, plus the product's rounding."""
    return w * 2 * _ulp(w.rsqrt(), torch.float32) + _ulp(w.sqrt(), torch.float32)


def _bound_fast_tan(y):
    """tan(y) = sin(y) * (1 / cos(y)) for y in [-pi, pi]: sin and cos 2^-13 absolute, the
    reciprocal 1 ulp and the product's rounding; 1% for the second-order terms."""
    s, c = y.sin(), y.cos()
    first = 2.0**-13 * (1 / c.abs() + s.abs() / c**2)
    return 1.01 * (first + 2 * _ulp(y.tan(), torch.float32))


def _check_table_8_2_trigonometric_and_hyperbolic_rows(x, exact, worst):
    """Columns 8 to 17 of lang_precision_composed: each within the error its Table 8.2 row
    composes (the formula over the fast pieces), and moved from the exact result."""
    f32 = torch.float32
    sgn = torch.where(torch.arange(64) % 2 == 1, 0.75, -0.75).double()
    p = _f32(x.abs() + 0.25)
    h, q, e = _f32(x / 2), _f32(x / 4), _f32(x / 8)
    t3 = _f32(x / 3)
    a = _f32(p + 1)
    truth = torch.stack(
        [
            h.tan(),
            x.tanh(),
            (torch.pi * e).tan(),
            p.sqrt(),
            torch.atan2(sgn, x),
            x.asinh(),
            a.acosh(),
            q.atanh(),
            (torch.pi * t3).sin(),
            (torch.pi * t3).cos(),
        ],
        1,
    )
    # Exact mode: the shim's binary32 functions, within 2 ulp.
    assert ((exact[:, 8:] - truth).abs() <= 2 * _ulp(truth, f32)).all()
    # tanh = (t - 1) / (t + 1), t = exp(2x): exp's bound at 2x through both roundings of the
    # sum and difference, then the divide's 2.5 ulp.
    t = (2 * x).exp()
    e_t = (3 + (4 * x).abs().floor()) * _ulp(t, f32)
    e_num, e_den = e_t + _ulp(t - 1, f32) / 2, e_t + _ulp(t + 1, f32) / 2
    b_tanh = 1.01 * (e_num / (t + 1) + (t - 1).abs() * e_den / (t + 1) ** 2) + 2.5 * _ulp(
        truth[:, 1], f32
    )
    # tanpi(e) = tan(e * M_PI_F): the product's distance from pi e, then tan's bound.
    y = _f32(e * _f32(torch.tensor(torch.pi, dtype=torch.float64)))
    b_tanpi = (y.tan() - truth[:, 2]).abs() + _bound_fast_tan(y)
    # atan2(s, x) = atan(s / x) (+/- M_PI_F for x < 0): the divide's 2.5 ulp through atan's
    # slope, atan's 5 ulp, M_PI_F's distance from pi and the sum's rounding.
    r = sgn / x
    b_atan2 = (
        1.01 * 2.5 * _ulp(r, f32) / (1 + r**2)
        + 5 * _ulp(r.atan(), f32)
        + torch.where(x < 0, 1e-7 + _ulp(truth[:, 4], f32), 0.0)
    )

    # log(x + sqrt(x * x +/- 1)): the square's and the sum's roundings, the fast sqrt, the
    # outer sum's rounding through log's slope 1/u, then log's bound.
    def b_log_of_sqrt(v, c):
        w = v * v + c
        s_ = w.sqrt()
        e_w = _ulp(v * v, f32) / 2 + _ulp(w, f32) / 2
        e_s = e_w / (2 * s_) + _bound_fast_sqrt(w)
        u = v + s_
        return 1.01 * (e_s + _ulp(u, f32) / 2) / u + _bound_log(u)

    # atanh(q) = 0.5 log((1 + q) / (1 - q)): both roundings and the divide's 2.5 ulp relative,
    # through log's slope, then log's bound, halved.
    rq = (1 + q) / (1 - q)
    rel = _ulp(1 + q, f32) / 2 / (1 + q) + _ulp(1 - q, f32) / 2 / (1 - q) + 2.5 * _ulp(rq, f32) / rq
    b_atanh = 0.5 * (1.01 * rel + _bound_log(rq))
    bounds = torch.stack(
        [
            _bound_fast_tan(h),
            b_tanh,
            b_tanpi,
            _bound_fast_sqrt(p),
            b_atan2,
            b_log_of_sqrt(x, 1.0),
            b_log_of_sqrt(a, -1.0),
            b_atanh,
            torch.full_like(x, 2.0**-13),
            torch.full_like(x, 2.0**-13),
        ],
        1,
    )
    err = (worst[:, 8:] - truth).abs()
    assert (err <= bounds).all(), (err / bounds).max(0)
    assert ((worst[:, 8:] != exact[:, 8:]).float().mean(0) > 0.5).all()


def test_worst_precision_follows_table_8_2_implementations_and_table_8_3(monkeypatch):
    x, exact, hexact = _composed_run(monkeypatch, None)
    _, worst, hworst = _composed_run(monkeypatch, "worst")
    f32 = torch.float32
    p = (x.float().abs() + 0.25).double()
    q = (x.float() / 4).double()
    truth = torch.stack(
        [10**x, p.log10(), p**1.5, x.sinh(), x.cosh(), q.asin(), q.acos(), x.atan()], 1
    )
    # Exact mode: the shim's binary32 functions (glibc's, within 2 ulp by its own tables; the
    # precise Table 8.1 allows 4 to 16).
    assert ((exact[:, :8] - truth).abs() <= 2 * _ulp(truth, f32)).all()
    # exp10(x) = exp2(y) with y = x * log2(10) rounded to float: exp2's bound at y (3 +
    # floor(|2y|) ulp) plus what the product's rounding moves 2^y from 10^x.
    y = (x.float() * torch.tensor(3.32192809488736234787).float()).double()
    b_exp10 = (2**y - 10**x).abs() + (3 + (2 * y).abs().floor()) * _ulp(2**y, f32)
    # log10(p) = log2(p) * log10(2): log2's bound (2^-22 absolute in [0.5, 2], else 2 ulp)
    # scaled by log10(2), plus the constant's and the product's roundings.
    in_half = (p >= 0.5) & (p <= 2.0)
    b_log2 = torch.where(in_half, 2.0**-22, 2 * _ulp(p.log2(), f32))
    b_log10 = 0.30103 * b_log2 + 2 * _ulp(truth[:, 1], f32)
    # pow(p, 1.5) = exp2(1.5 log2(p)): log2's error times 1.5 ln(2) relative, then exp2's.
    t = 1.5 * p.log2()
    b_pow = truth[:, 2] * (1.5 * b_log2 + 2 * _ulp(t, f32)) * 0.6932 + (
        3 + (2 * t).abs().floor()
    ) * _ulp(truth[:, 2], f32) * (1 + 2**-10)
    # sinh, cosh = 0.5 (exp(x) -/+ exp(-x)): both exp bounds, plus the sum's rounding.
    b_exp = (3 + (2 * x).abs().floor()) * (_ulp(x.exp(), f32) + _ulp((-x).exp(), f32))
    b_sinh = 0.5 * b_exp + _ulp(truth[:, 3], f32)
    b_cosh = 0.5 * b_exp + _ulp(truth[:, 4], f32)
    bounds = torch.stack(
        [
            b_exp10,
            b_log10,
            b_pow,
            b_sinh,
            b_cosh,
            5 * _ulp(truth[:, 5], f32),
            5 * _ulp(truth[:, 6], f32),
            5 * _ulp(truth[:, 7], f32),
        ],
        1,
    )
    err = (worst[:, :8] - truth).abs()
    assert (err <= bounds).all(), (err / bounds).max()
    assert ((worst[:, :8] != exact[:, :8]).float().mean(0) > 0.5).all()
    _check_table_8_2_trigonometric_and_hyperbolic_rows(x, exact, worst)
    # Half: rsqrt is correctly rounded (Table 8.3) and stays; sinpi and asinh may be 1 ulp off;
    # fdim is exact.
    hp = p.half().double()
    hx = x.half().double()
    assert torch.equal(hexact[:, 0], hp.rsqrt().half().double())
    assert torch.equal(hworst[:, 0], hexact[:, 0])
    hf = torch.stack([torch.sin(torch.pi * hx), hx.asinh()], 1)
    assert ((hexact[:, 1:3] - hf).abs() <= 0.5 * _ulp(hf, torch.float16) + 1e-7).all()
    assert ((hworst[:, 1:3] - hf).abs() <= _ulp(hf, torch.float16) * (1 + 2**-10) + 1e-7).all()
    assert (hworst[:, 1:3] != hexact[:, 1:3]).float().mean() > 0.3
    assert torch.equal(hexact[:, 3], (hx - 0.5).clamp(min=0).half().double())
    assert torch.equal(hworst[:, 3], hexact[:, 3])


def test_worst_precision_is_deterministic_per_seed(monkeypatch):
    _, a, ha = _precision_run(monkeypatch, "worst", seed=7)
    _, b, hb = _precision_run(monkeypatch, "worst", seed=7)
    _, c, hc = _precision_run(monkeypatch, "worst", seed=8)
    assert torch.equal(a, b) and torch.equal(ha, hb)
    assert not torch.equal(a, c)


def test_unknown_precision_mode_is_refused(monkeypatch):
    monkeypatch.setenv("TORCH_STEEL_SIM_FAST_MATH", "sloppy")
    with pytest.raises(SimulatorError, match="expected exact or worst"):
        _precision_run(monkeypatch, "sloppy")
