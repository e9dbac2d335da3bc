"""simdgroup_matrix<T, 8, 8>: Apple's fragment map, simdgroup_load / simdgroup_store with
elements_per_row, matrix_origin (x = column, y = row of the source, also when transposed) and
transpose_matrix, from device and threadgroup memory, and simdgroup_multiply_accumulate bit-exact to
the order DESIGN.md states: start from C, add the eight products in index order, all in binary32,
round to D's type (kernels: tests/sim/kernels/lang_simdgroup_matrix.metal).
"""

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from sim_helpers import requires_clang

KERNELS = Path(__file__).parent / "kernels"
SRC = [KERNELS / "lang_simdgroup_matrix.metal"]


pytestmark = requires_clang

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def run(name, **kw):
    from torch_steel import sim

    return sim.run_kernel(name, sources=SRC, **kw)


def lane_elements(lane: int) -> tuple[int, int]:
    """(row, first column) of a lane's two elements, as DESIGN.md section 4 states the map."""
    q = lane // 4
    return (q & 4) + (lane // 2) % 4, (q & 2) * 2 + (lane % 2) * 2


def test_fragment_map():
    out = torch.full((64,), -1.0)
    run("lang_fragment_map", grid=(1,), threads=(32,), buffers={0: out})
    expected = torch.full((8, 8), -1.0)
    for lane in range(32):
        r, c = lane_elements(lane)
        expected[r, c], expected[r, c + 1] = 2 * lane, 2 * lane + 1
    assert torch.equal(out.view(8, 8), expected)
    assert sorted(out.tolist()) == list(range(64))  # every element owned exactly once


def load_store_args(src_per_row, src_xy, src_t, dst_per_row, dst_xy, dst_t) -> bytes:
    return struct.pack("8I", src_per_row, *src_xy, int(src_t), dst_per_row, *dst_xy, int(dst_t))


def expected_load_store(src, dst, src_per_row, src_xy, src_t, dst_per_row, dst_xy, dst_t):
    """The matrix M with M[r, c] = src[(y + r) * per_row + x + c] (src[(y + c) * per_row + x + r]
    when transposed), stored the same way into a copy of dst."""
    out = dst.clone()
    sx, sy = src_xy
    dx, dy = dst_xy
    for r in range(8):
        for c in range(8):
            i = (sy + c) * src_per_row + sx + r if src_t else (sy + r) * src_per_row + sx + c
            j = (dy + c) * dst_per_row + dx + r if dst_t else (dy + r) * dst_per_row + dx + c
            out[j] = src[i]
    return out


LAYOUTS = {
    "plain": (8, (0, 0), False, 8, (0, 0), False),
    "strided_origin": (13, (3, 2), False, 11, (2, 5), False),
    "transpose_load": (12, (0, 0), True, 10, (0, 1), False),
    "transpose_store": (9, (4, 1), False, 16, (0, 0), True),
    "transpose_both": (20, (0, 0), True, 17, (0, 0), True),
    "transpose_load_origin": (13, (3, 2), True, 11, (1, 4), False),
    "transpose_store_origin": (10, (1, 3), False, 12, (3, 1), True),
    "transpose_both_origin": (16, (5, 2), True, 9, (0, 3), True),
}


@pytest.mark.parametrize("memory", ["device", "threadgroup"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tname", list(DTYPES))
def test_load_store(tname, layout, memory):
    dtype = DTYPES[tname]
    n = 400
    src = (torch.arange(n) % 250 - 125).to(dtype)  # exact in every type, distinct within 250
    dst = torch.full((n,), -500.0, dtype=dtype)
    args = LAYOUTS[layout]
    expected = expected_load_store(src, dst, *args)
    buffers = {0: src, 1: dst, 2: load_store_args(*args)}
    if memory == "device":
        run(f"lang_load_store_{tname}", grid=(1,), threads=(32,), buffers=buffers)
    else:
        buffers[3] = struct.pack("I", n)
        run(f"lang_load_store_tg_{tname}", grid=(1,), threads=(32,), buffers=buffers)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("memory", ["device", "threadgroup"])
@pytest.mark.parametrize("tname", list(DTYPES))
def test_transpose_with_origin_matches_metal_jl_hardware_test(tname, memory):
    """The case Metal.jl's test suite checks on Apple GPUs (test/device/intrinsics/simd.jl,
    "load_store"): a column-major 20x15 array `a` is loaded with the transpose flag,
    elements_per_row 20 and origin (3, 1) (0-based row, column of the array), stored with the
    transpose flag into a column-major 15x20 array `b` at origin (2, 4), and then a[3:11, 1:9]
    == b[2:10, 4:12]. So the origin addresses the source (x = column, y = row of its row-major
    view) and the block there is transposed; the opposite convention (origin in the transposed
    matrix's coordinates) moves both blocks.
    """
    dtype = DTYPES[tname]
    a = (torch.arange(20 * 15) % 250 - 125).to(dtype).reshape(15, 20).t()  # [20, 15] col-major
    b = torch.full((20, 15), -500.0, dtype=dtype).t()  # [15, 20] col-major
    a_mem = a.t().contiguous().view(-1)
    b_mem = b.t().contiguous().view(-1)
    buffers = {0: a_mem, 1: b_mem, 2: load_store_args(20, (3, 1), True, 15, (2, 4), True)}
    name = f"lang_load_store_{tname}"
    if memory == "threadgroup":
        buffers[3] = struct.pack("I", 300)
        name = f"lang_load_store_tg_{tname}"
    run(name, grid=(1,), threads=(32,), buffers=buffers)
    b_out = b_mem.view(20, 15).t()
    assert torch.equal(b_out[2:10, 4:12], a[3:11, 1:9])
    untouched = torch.ones(15, 20, dtype=torch.bool)
    untouched[2:10, 4:12] = False
    assert torch.equal(b_out[untouched], torch.full((15 * 20 - 64,), -500.0, dtype=dtype))


LANE_ARGS = ["load_pointer", "load_elements_per_row", "load_origin", "load_transpose", "store"]


@pytest.mark.parametrize("what", range(len(LANE_ARGS)), ids=LANE_ARGS)
def test_load_store_arguments_must_be_the_same_in_every_lane(what):
    """A simdgroup_load / simdgroup_store is one matrix operation of the simdgroup: arguments that
    differ between lanes are an error, not a per-lane gather or scatter."""
    from torch_steel.errors import SimulatorError

    src = torch.arange(128, dtype=torch.float32)
    dst = torch.zeros(128)
    buffers = {0: src, 1: dst, 2: struct.pack("2I", what, 32)}
    run("lang_matrix_lane_args", grid=(1,), threads=(32,), buffers=buffers)
    assert torch.equal(dst[:64], src[:64])
    buffers[2] = struct.pack("2I", what, 16)
    op = "simdgroup_store" if LANE_ARGS[what] == "store" else "simdgroup_load"
    with pytest.raises(SimulatorError, match=f"{op}: the lanes of the simdgroup pass different"):
        run("lang_matrix_lane_args", grid=(1,), threads=(32,), buffers=buffers)


def mma_reference(a, b, c, out_dtype):
    """D = A B + C as DESIGN.md states: acc = C[r, c]; acc += A[r, k] * B[k, c] for k = 0..7,
    every product and sum rounded to binary32; then rounded to D's type."""
    a32 = a.float().numpy()
    b32 = b.float().numpy()
    acc = c.float().numpy().copy() if c is not None else np.zeros((8, 8), np.float32)
    for k in range(8):
        acc = (acc + np.outer(a32[:, k], b32[k, :]).astype(np.float32)).astype(np.float32)
    return torch.from_numpy(acc).to(out_dtype)


MMA_TYPES = [
    ("f32", "f16", "f16", "f32"),
    ("f32", "bf16", "bf16", "f32"),
    ("f32", "f32", "f32", "f32"),
    ("f16", "f16", "f16", "f16"),
    ("bf16", "bf16", "bf16", "bf16"),
    ("f16", "f16", "f16", "f32"),
    ("f32", "f16", "f32", "f16"),
]


def mma_operands(ta, tb, tc, seed):
    g = torch.Generator().manual_seed(seed)
    # Wide exponent range: the order of the additions changes the rounded result.
    scale = torch.tensor([2.0**e for e in range(-6, 6)])
    pick = lambda: scale[torch.randint(0, len(scale), (8, 8), generator=g)]  # noqa: E731
    a = (torch.randn(8, 8, generator=g) * pick()).to(DTYPES[ta])
    b = (torch.randn(8, 8, generator=g) * pick()).to(DTYPES[tb])
    c = (torch.randn(8, 8, generator=g) * 50).to(DTYPES[tc])
    return a, b, c


@pytest.mark.parametrize("types", MMA_TYPES, ids=["_".join(t) for t in MMA_TYPES])
@pytest.mark.parametrize("mode", ["accumulate", "multiply"])
def test_mma_is_bit_exact_to_the_stated_order(types, mode):
    td, ta, tb, tc = types
    a, b, c = mma_operands(ta, tb, tc, seed=11)
    d = torch.full((8, 8), -9.0, dtype=DTYPES[td])
    run(
        f"lang_mma_{'_'.join(types)}",
        grid=(1,),
        threads=(32,),
        buffers={0: a, 1: b, 2: c, 3: d, 4: struct.pack("I", 0 if mode == "accumulate" else 1)},
    )
    expected = mma_reference(a, b, c if mode == "accumulate" else None, DTYPES[td])
    assert torch.equal(
        d.view(torch.int16 if d.element_size() == 2 else torch.int32),
        expected.view(torch.int16 if d.element_size() == 2 else torch.int32),
    )


def test_mma_reference_order_matters():
    """The operands above make the summation order visible: a float64 product differs."""
    a, b, c = mma_operands("f16", "f16", "f32", seed=11)
    ordered = mma_reference(a, b, c, torch.float32)
    exact = (a.double() @ b.double() + c.double()).float()
    assert not torch.equal(ordered, exact)


def test_mma_accumulator_aliasing_destination():
    a, b, c = mma_operands("f16", "f16", "f32", seed=12)
    acc = c.clone()
    run("lang_mma_inplace_f16", grid=(1,), threads=(32,), buffers={0: a, 1: b, 2: acc})
    once = mma_reference(a, b, c, torch.float32)
    assert torch.equal(acc, mma_reference(a, b, once, torch.float32))


def test_diagonal_and_filled_matrices():
    out = torch.zeros(128)
    run("lang_matrix_init", grid=(1,), threads=(32,), buffers={0: out})
    assert torch.equal(out[:64].view(8, 8), torch.eye(8) * 2.5)
    assert torch.equal(out[64:], torch.full((64,), -1.0))


def test_mma_with_exited_lanes_is_an_error():
    from torch_steel.errors import SimulatorError

    out = torch.zeros(64)
    with pytest.raises(SimulatorError, match="lang_mma_after_exit"):
        run(
            "lang_mma_after_exit",
            grid=(1,),
            threads=(32,),
            buffers={0: out, 1: struct.pack("I", 20)},
        )
    run("lang_mma_after_exit", grid=(1,), threads=(32,), buffers={0: out, 1: struct.pack("I", 32)})
    assert torch.equal(out, torch.full((64,), 9.0))  # 1 + 8 * (1 * 1)


def test_uninitialized_matrix_reads_nan():
    a = torch.eye(8).flatten()
    out = torch.zeros(128)
    run("lang_uninitialized_acc", grid=(2,), threads=(32,), buffers={0: a, 1: out})
    assert torch.isnan(out).all()


@pytest.mark.parametrize("what", [0, 1], ids=["load", "store"])
def test_load_and_store_with_exited_lanes_are_refused(what):
    from torch_steel.errors import SimulatorError

    out = torch.zeros(128)
    run(
        "lang_load_store_after_exit",
        grid=(1,),
        threads=(32,),
        buffers={0: out, 1: struct.pack("<II", what, 32)},
    )
    name = "simdgroup_load" if what == 0 else "simdgroup_store"
    with pytest.raises(SimulatorError, match=name + " with inactive lanes"):
        run(
            "lang_load_store_after_exit",
            grid=(1,),
            threads=(32,),
            buffers={0: out, 1: struct.pack("<II", what, 16)},
        )
