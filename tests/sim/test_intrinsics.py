"""simd_* functions against their definitions, with lanes that exited first, and metal:: math
against torch (kernels: tests/sim/kernels/lang_intrinsics.metal).

Definitions the shim implements (mps_src/sim/shim/steel_shim/simd.h): exited lanes take no part;
reductions, prefix sums and votes cover the active lanes in ascending lane order, in T's
precision; reading an exited lane's value (undefined on the GPU) gives all-one bits, a NaN for
floating point.
"""

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from sim_helpers import requires_clang

KERNELS = Path(__file__).parent / "kernels"
SRC = [KERNELS / "lang_intrinsics.metal"]
FLOAT_RESULTS = 14
UINT_RESULTS = 6


pytestmark = requires_clang


def run(name, **kw):
    from torch_steel import sim

    return sim.run_kernel(name, sources=SRC, **kw)


TYPES = {
    "f32": (torch.float32, np.float32),
    "f16": (torch.float16, np.float16),
    "i32": (torch.int32, np.int32),
}


def fold(values, op):
    acc = values[0]
    for v in values[1:]:
        acc = op(acc, v)
    return acc


def expected_simd(x: np.ndarray, active: list[int], undefined):
    """Per lane of one simdgroup (x: its 32 values), the 14 value results and 6 uint results."""
    first = active[0]
    vals, uvals = {}, {}
    zero = x.dtype.type(0)

    def at(src):
        return x[src] if 0 <= src < 32 and src in active else undefined

    mask = sum(1 << a for a in active)
    ballot = sum(1 << a for a in active if x[a] > 0)
    for lane in active:
        below = [x[a] for a in active if a < lane]
        upto = below + [x[lane]]
        vals[lane] = [
            at((lane * 7 + 3) % 32),
            at(lane ^ 5),
            at(lane - 3) if lane >= 3 else x[lane],
            at(lane + 3) if lane + 3 < 32 else x[lane],
            at((lane - 3) % 32),
            at((lane + 3) % 32),
            at(9),
            x[first],
            fold([x[a] for a in active], lambda p, q: p + q),
            max(x[a] for a in active),
            min(x[a] for a in active),
            fold(upto, lambda p, q: p + q),
            fold(below, lambda p, q: p + q) if below else zero,
            fold([x[a] for a in active], lambda p, q: p * q),
        ]
        uvals[lane] = [
            ballot,
            int(all(x[a] > 0 for a in active)),
            int(any(x[a] > 0 for a in active)),
            int(lane == first),
            mask,
            sum(active),
        ]
    return vals, uvals


EXIT_MASKS = {
    "all_active": [0, 0],
    "some_exited": [0b1000_0000_0000_0000_0000_0010_0000_0001, 0xFFFF0000],
    "only_lane_31": [0x7FFFFFFF, 0],
}


@pytest.mark.parametrize("tname", list(TYPES))
@pytest.mark.parametrize("exits", list(EXIT_MASKS))
def test_simd_functions_match_their_definitions(tname, exits):
    tdtype, ndtype = TYPES[tname]
    g = torch.Generator().manual_seed(3)
    if tdtype.is_floating_point:
        # Signed values with few significant bits keep the products finite.
        x = (torch.randint(-8, 9, (64,), generator=g) / 4).to(tdtype)
    else:
        x = torch.randint(-3, 4, (64,), generator=g, dtype=tdtype)
    sentinel = -77
    out = torch.full((64 * FLOAT_RESULTS,), sentinel, dtype=tdtype)
    uout = torch.full((64 * UINT_RESULTS,), 12345, dtype=torch.int64).to(torch.int32)
    masks = EXIT_MASKS[exits]
    exit_mask = torch.tensor(
        [m - (1 << 32) if m >= 1 << 31 else m for m in masks], dtype=torch.int32
    )
    run(
        f"lang_simd_{tname}",
        grid=(1,),
        threads=(64,),
        buffers={0: x, 1: out, 2: uout, 3: exit_mask},
    )
    out = out.view(64, FLOAT_RESULTS).numpy()
    uout = uout.view(64, UINT_RESULTS).numpy().astype(np.uint32)
    xn = x.numpy()
    undefined = (
        np.array(-1, dtype=np.int32).view(np.float32)
        if ndtype == np.float32
        else (
            np.array(-1, dtype=np.int16).view(np.float16) if ndtype == np.float16 else np.int32(-1)
        )
    )
    for sg in range(2):
        active = [lane for lane in range(32) if not (masks[sg] >> lane) & 1]
        vals, uvals = expected_simd(xn[32 * sg : 32 * sg + 32].astype(ndtype), active, undefined)
        for lane in range(32):
            row, urow = out[32 * sg + lane], uout[32 * sg + lane]
            if lane not in active:
                assert (row == sentinel).all() and (urow == 12345).all()
                continue
            exp = np.array(vals[lane], dtype=ndtype)
            if tdtype.is_floating_point:
                np.testing.assert_array_equal(np.isnan(row), np.isnan(exp), err_msg=f"lane {lane}")
                ok = np.isnan(exp) | (row == exp)
                assert ok.all(), f"sg {sg} lane {lane}: {row} != {exp}"
            else:
                np.testing.assert_array_equal(row, exp, err_msg=f"sg {sg} lane {lane}")
            np.testing.assert_array_equal(urow, np.array(uvals[lane], dtype=np.uint32))


def test_simd_sum_order_is_ascending_lanes_in_t_precision():
    # 1 + 32 * 2^-11: in half, adding 2^-11 to 1.0 is a tie that rounds back to 1.0 each time;
    # an order that first summed the small values would reach 1 + 2^-6.
    x = torch.full((64,), 2.0**-11, dtype=torch.float16)
    x[0] = 1.0
    out = torch.zeros(64 * FLOAT_RESULTS, dtype=torch.float16)
    uout = torch.zeros(64 * UINT_RESULTS, dtype=torch.int32)
    run(
        "lang_simd_f16",
        grid=(1,),
        threads=(64,),
        buffers={0: x, 1: out, 2: uout, 3: torch.zeros(2, dtype=torch.int32)},
    )
    assert out.view(64, FLOAT_RESULTS)[0, 8].item() == 1.0


def test_simd_functions_on_vectors_act_per_component():
    x = torch.arange(64, dtype=torch.float32).view(32, 2) * torch.tensor([1.0, -1.0])
    out = torch.zeros(32 * 3, 2)
    run("lang_simd_vector", grid=(1,), threads=(32,), buffers={0: x, 1: out})
    out = out.view(32, 3, 2)
    assert torch.equal(out[:, 0], x.sum(0).expand(32, 2))
    assert torch.equal(out[:, 1], x[torch.arange(32) ^ 1])
    assert torch.equal(out[:, 2], x.max(0).values.expand(32, 2))


MATH_RESULTS = 24


@pytest.mark.parametrize("tname", ["f32", "f16"])
def test_math_functions(tname):
    tdtype = TYPES[tname][0]
    g = torch.Generator().manual_seed(5)
    n = 128
    x = (torch.randn(n, generator=g) * 3).to(tdtype)
    y = (torch.randn(n, generator=g) * 3).to(tdtype)
    x[:6] = torch.tensor([0.5, -0.5, 2.5, -2.5, float("inf"), float("nan")]).to(tdtype)
    out = torch.zeros(n * MATH_RESULTS, dtype=tdtype)
    run(f"lang_math_{tname}", grid=(2,), threads=(64,), buffers={0: x, 1: y, 2: out})
    out = out.view(n, MATH_RESULTS).float()
    a, b = x.float().double(), y.float().double()
    # Evaluated in float64 here, in binary32 then rounded to T there: 2 ulp of T covers the
    # binary32 libm error (<= 1 ulp of float) plus the final rounding.
    ulp = 2.0**-23 if tdtype == torch.float32 else 2.0**-10
    rounded_away = torch.sign(a) * torch.floor(a.abs() + 0.5)  # MSL round(): ties away from 0
    fmax = torch.finfo(tdtype).max
    approx = {
        0: a.exp(),
        1: torch.exp2(a),
        2: a.abs().log(),
        3: a.abs().log2(),
        4: a.abs().sqrt(),
        5: a.abs().rsqrt(),
        6: a.tanh(),
        7: a.exp(),
        8: a.tanh(),
        13: a * b + a,
        21: a.abs().pow(b),
    }
    exact = {
        9: torch.maximum(a, b),
        10: torch.minimum(a, b),
        11: a.clamp(-1, 1),
        12: a.abs(),
        14: torch.where(a < b, b, a),
        15: a.floor(),
        16: a.ceil(),
        17: rounded_away,
        18: a.trunc(),
        19: a.isnan().double(),
        20: a.isinf().double(),
        22: torch.maximum(a, b),
    }
    for j, e in approx.items():
        e = e.to(tdtype).double()
        got = out[:, j].double()
        close = torch.isclose(got, e, rtol=2 * ulp, atol=0, equal_nan=True)
        assert close.all(), f"result {j}: {got[~close][:4]} vs {e[~close][:4]}"
    for j, e in exact.items():
        e = e.to(tdtype).double()
        got = out[:, j].double()
        if j in (9, 10, 22):
            # IEEE maxNum/minNum: a NaN operand yields the other one (torch propagates NaN).
            e = torch.where(a.isnan(), b, e)
        if j == 11:
            e = torch.where(a.isnan(), -1.0, e)  # MSL: clamp(x, lo, hi) = fmin(fmax(x, lo), hi)
        assert torch.equal(got.nan_to_num(123.0), e.nan_to_num(123.0)), f"result {j}"
    assert (out[:, 23] == fmax).all()


FAST_MINMAX = ["max", "min", "clamp", "fmax", "fmin", "max_vector", "saturate"]


@pytest.mark.parametrize("which", range(len(FAST_MINMAX)), ids=FAST_MINMAX)
def test_fast_min_max_clamp_refuse_nan(which):
    """fast::min/max/clamp (and fmin/fmax) are undefined for NaN operands in Metal (only the
    precise:: forms are IEEE minNum/maxNum), so a kernel that feeds them a NaN must not pass with
    the IEEE answer; infinities are fine."""
    from torch_steel.errors import SimulatorError

    a = torch.tensor([1.0, -3.0, float("inf"), -float("inf")] * 8)
    b = torch.tensor([2.0, -4.0, 0.5, float("inf")] * 8)
    out = torch.zeros(32)
    args = struct.pack("I", which)
    run("lang_fast_minmax", grid=(1,), threads=(32,), buffers={0: a, 1: b, 2: out, 3: args})
    name = FAST_MINMAX[which]
    expected = {
        "max": torch.maximum(a, b),
        "min": torch.minimum(a, b),
        "clamp": torch.maximum(a, b),  # fast::clamp(a, b, INFINITY)
        "fmax": torch.maximum(a, b),
        "fmin": torch.minimum(a, b),
        "max_vector": torch.maximum(a, b),
        "saturate": a.clamp(0, 1) + b.clamp(0, 1),
    }[name]
    assert torch.equal(out, expected)
    for nan_in in (a, b):
        nan_in[5] = float("nan")
        with pytest.raises(SimulatorError, match=rf"fast::{name.split('_')[0]} with a NaN"):
            run(
                "lang_fast_minmax",
                grid=(1,),
                threads=(32,),
                buffers={0: a, 1: b, 2: out, 3: args},
            )
        nan_in[5] = 1.0


SHIFTS = [
    "down",
    "up",
    "rotate_down",
    "rotate_up",
    "fill_down",
    "fill_up",
    "fill_modulo",
    "xor",
    "broadcast",
]


def shifted(x: torch.Tensor, which: str) -> torch.Tensor:
    """Each shift with delta 1 (modulo 16 for fill_modulo), by its MSL definition."""
    lane = torch.arange(32)
    if which == "down":
        return x[torch.where(lane + 1 < 32, lane + 1, lane)]
    if which == "up":
        return x[torch.where(lane >= 1, lane - 1, lane)]
    if which == "rotate_down":
        return x[(lane + 1) % 32]
    if which == "rotate_up":
        return x[(lane + 31) % 32]
    if which == "xor":
        return x[lane ^ 1]
    if which == "broadcast":
        return x[torch.ones(32, dtype=torch.long)]
    fill = -x
    if which == "fill_down":
        return torch.where(lane + 1 < 32, x[(lane + 1) % 32], fill[(lane + 1) % 32])
    if which == "fill_up":
        return torch.where(lane >= 1, x[(lane + 31) % 32], fill[(lane + 31) % 32])
    base, src = lane - lane % 16, lane % 16 + 1
    return torch.where(src < 16, x[base + src % 16], fill[base + src % 16])


@pytest.mark.parametrize("which", range(len(SHIFTS)), ids=SHIFTS)
def test_shift_delta_must_be_uniform(which):
    """MSL: "the value for delta needs to be the same for all threads in the SIMD-group" (the
    shifts, rotations and fills), likewise simd_shuffle_xor's mask, and simd_broadcast's lane is
    undefined otherwise: one that differs between lanes (here: 1 below lane 16, 2 from lane 16)
    is an error, not a per-lane shift."""
    from torch_steel.errors import SimulatorError

    x = torch.arange(32, dtype=torch.float32) + 1
    out = torch.zeros(32)
    run(
        "lang_shuffle_delta",
        grid=(1,),
        threads=(32,),
        buffers={0: x, 1: out, 2: struct.pack("2I", which, 32)},
    )
    assert torch.equal(out, shifted(x, SHIFTS[which]))
    with pytest.raises(SimulatorError, match="differs between the lanes"):
        run(
            "lang_shuffle_delta",
            grid=(1,),
            threads=(32,),
            buffers={0: x, 1: out, 2: struct.pack("2I", which, 16)},
        )


@pytest.mark.parametrize("modulo", [2, 4, 8, 16, 32, 3, 12, 64])
def test_fill_modulo_must_be_a_power_of_two_up_to_32(modulo):
    from torch_steel.errors import SimulatorError

    x = torch.arange(32, dtype=torch.float32) + 1
    out = torch.zeros(32)
    args = struct.pack("2I", 100 + modulo, 32)
    kw = dict(grid=(1,), threads=(32,), buffers={0: x, 1: out, 2: args})
    if modulo in (2, 4, 8, 16, 32):
        run("lang_shuffle_delta", **kw)
        lane = torch.arange(32)
        base, src = lane - lane % modulo, lane % modulo + 1
        expected = torch.where(src < modulo, x[base + src % modulo], -x[base + src % modulo])
        assert torch.equal(out, expected)
    else:
        with pytest.raises(SimulatorError, match="modulo must be 2, 4, 8, 16 or 32"):
            run("lang_shuffle_delta", **kw)


@pytest.mark.parametrize("active", [32, 20])
def test_vote_all_and_any_look_at_every_thread(active):
    """MSL 6.9.2: "simd_ballot(expr).all() returns true if all threads were active and evaluated
    the expr to true. (simd_vote::all() does not look at which threads are active.)", unlike
    simd_all; the ballot sets the bits of inactive threads to 0."""
    out = torch.full((32 * 8,), 7, dtype=torch.int32)
    run(
        "lang_votes",
        grid=(1,),
        threads=(32,),
        buffers={0: out, 1: struct.pack("I", active)},
    )
    got = out.view(32, 8)[:active]
    evens = sum(1 << lane for lane in range(0, active, 2))
    everyone = int(active == 32)
    expected = [everyone, 1, 1, 1, evens - (1 << 32 if evens >= 1 << 31 else 0), 1, 0, everyone]
    assert got.tolist() == [expected] * active
    assert (out.view(32, 8)[active:] == 7).all()


def test_clamp_with_an_empty_range_is_an_error():
    """MSL 6.2 / 6.3: clamp's "results are undefined if minval > maxval" (for example
    clamp(i, 0, n - 1) with n == 0)."""
    from torch_steel.errors import SimulatorError

    ok = torch.tensor([[5.0, 0.0, 3.0, -1.0], [2.0, 2.0, 2.0, 9.0], [-1.0, -3.0, 0.0, 1.0]])
    out = torch.zeros(6)
    run("lang_clamp", grid=(3,), threads=(1,), buffers={0: ok, 1: out})
    assert out.tolist() == [3.0, 0.0, 2.0, 2.0, -1.0, 0.0]
    for bad in ([1.0, 1.0, 0.0, 0.0], [0.0, 0.0, -1.0, 0.0]):
        with pytest.raises(SimulatorError, match="clamp with minval > maxval"):
            run("lang_clamp", grid=(1,), threads=(1,), buffers={0: torch.tensor([bad]), 1: out})


def test_vector_math_and_comparison_reductions():
    # Column 3: fma(a, b, a) rounds once, a * b + a twice, and the two differ.
    x = torch.tensor([[1.0, -2.0, 0.5, -2.3250308], [2.0, -3.0, 0.25, -0.21879166]])
    out = torch.zeros(6, 4)
    flags = torch.zeros(3, dtype=torch.int32)
    run("lang_math_vector", grid=(1,), threads=(1,), buffers={0: x, 1: out, 2: flags})
    a, b = x
    assert (a[3] * b[3] + a[3]).item() != out[5, 3].item()
    assert torch.equal(out[0], torch.maximum(a, b))
    assert torch.equal(out[1], a.clamp(min=0))
    assert torch.equal(out[2], a.clamp(-1, 1))
    assert torch.equal(out[3], torch.where(a < b, b, a))
    assert torch.allclose(out[4], a.exp(), rtol=2e-7, atol=0)
    # These products and sums are exact in float64, so this is the singly rounded fma.
    assert torch.equal(out[5], (a.double() * b.double() + a.double()).float())
    assert flags.tolist() == [0, 1, 0]  # a < b only in some components; no NaN


def test_atomics():
    total = torch.zeros(1, dtype=torch.int32)
    ftotal = torch.zeros(1)
    biggest = torch.zeros(1, dtype=torch.int32)
    per_group = torch.zeros(4, dtype=torch.int32)
    run(
        "lang_atomics",
        grid=(4,),
        threads=(96,),
        buffers={0: total, 1: ftotal, 2: biggest, 3: per_group},
    )
    n = 4 * 96
    assert total.item() == n * (n - 1) // 2
    assert ftotal.item() == n * 0.5
    assert biggest.item() == max(g * 37 % 101 for g in range(n))
    assert per_group.tolist() == [96] * 4


def test_shuffle_and_fill():
    x = torch.arange(32.0)
    y = 100 + torch.arange(32.0)
    out = torch.zeros(32, 4)
    run("lang_simd_fill", grid=(1,), threads=(32,), buffers={0: x, 1: y, 2: out})

    def fill(lane, delta, modulo):
        base, pos = lane - lane % modulo, lane % modulo + delta
        if 0 <= pos < modulo:
            return x[base + pos]
        return y[base + (pos + modulo if pos < 0 else pos - modulo)]

    expected = torch.tensor(
        [[fill(i, 3, 32), fill(i, -5, 32), fill(i, 2, 8), fill(i, -3, 16)] for i in range(32)]
    )
    assert torch.equal(out, expected)
    assert out[31, 0] == 102 and out[0, 1] == 127  # filled from filling's low / high lanes
