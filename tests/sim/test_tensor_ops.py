"""MSL 4 tensors and mpp::tensor_ops::matmul2d in the simulator (shim/steel_shim/tensor.h,
tensor_ops.h; kernels: tests/sim/kernels/exec_tensor_ops_msl4.metal), against float64 math.

Cooperative-tensor layouts are drawn per seed (TORCH_STEEL_SIM_LAYOUT_SEED): a kernel that uses
the index API passes under every seed, one that hard-codes a layout fails.
"""

import struct
import textwrap
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel.errors import SimulatorError

KERNELS = Path(__file__).parent / "kernels"
SRC = [KERNELS / "exec_tensor_ops_msl4.metal"]

pytestmark = requires_clang

SEEDS = [0, 1, 2, 7, 12345]


def args(M, N, K, lda, ldb, ldd, row0=0, col0=0) -> bytes:
    return struct.pack("8i", M, N, K, lda, ldb, ldd, row0, col0)


def run(name, buffers, threads=32, counters=False, **kw):
    from torch_steel import sim

    return sim.run_kernel(
        name, sources=SRC, grid=(1,), threads=(threads,), buffers=buffers, counters=counters, **kw
    )


@pytest.fixture(params=SEEDS)
def seed(request, monkeypatch):
    monkeypatch.setenv("TORCH_STEEL_SIM_LAYOUT_SEED", str(request.param))
    return request.param


def operands(M, N, K, dtype, ta=False, tb=False, gen=0):
    g = torch.Generator().manual_seed(gen)
    a = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(K, N, generator=g).to(dtype)
    sa = a.t().contiguous() if ta else a  # stored K x M: a's columns contiguous
    sb = b.t().contiguous() if tb else b
    return a, b, sa, sb


def expected_block(a, b, row0, col0, m=32, n=32):
    ref = a.double() @ b.double()
    return ref[row0 : row0 + m, col0 : col0 + n]


@pytest.mark.parametrize(
    "name,dtype,ta,tb",
    [
        ("nn_f16", torch.float16, False, False),
        ("nt_f16", torch.float16, False, True),
        ("tn_f16", torch.float16, True, False),
        ("tt_f16", torch.float16, True, True),
        ("nn_bf16", torch.bfloat16, False, False),
        ("nn_f32", torch.float32, False, False),
    ],
)
def test_device_tensors_transposes_and_ragged_edges(name, dtype, ta, tb):
    # A 32 x 32 block at (32, 32) of a 45 x 50 product with K = 37: rows, columns and K past
    # the edges are zeros of dynamic extents; nothing past the output is written.
    M, N, K = 45, 50, 37
    a, b, sa, sb = operands(M, N, K, dtype, ta, tb)
    d = torch.full((M, N), -7.0)
    lda, ldb = sa.shape[1], sb.shape[1]
    c = run(
        f"tensor_mm_device_{name}",
        {0: sa, 1: sb, 2: d, 3: args(M, N, K, lda, ldb, N, 32, 32)},
        counters=True,
    )
    ref = expected_block(a, b, 32, 32)
    torch.testing.assert_close(d[32:, 32:].double(), ref, atol=1e-4, rtol=1e-4)
    assert (d[:32] == -7).all() and (d[:, :32] == -7).all()
    # Every operand element is read once (13 rows of a, 18 columns of b), each output written
    # once; the multiply-adds are m * n * K of the 32 x 32 operation.
    es = a.element_size()
    assert c["buffers"][0]["read"] == 13 * K * es
    assert c["buffers"][1]["read"] == 18 * K * es
    assert c["buffers"][2]["written"] == 13 * 18 * 4
    assert c["tensor_ops"] == 1 and c["tensor_multiply_adds"] == 32 * 32 * K


def test_four_simdgroup_scope():
    M, N, K = 40, 40, 24
    a, b, sa, sb = operands(M, N, K, torch.float16)
    d = torch.zeros(M, N)
    run("tensor_mm_device_nn_f16_sg4", {0: sa, 1: sb, 2: d, 3: args(M, N, K, K, N, N, 8, 0)}, 128)
    ref = expected_block(a, b, 8, 0)
    torch.testing.assert_close(d[8:40, 0:32].double(), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kernel,threads", [("tensor_mm_coop", 32), ("tensor_mm_coop_sg4", 128)])
def test_cooperative_destination_with_the_index_api_passes_under_every_seed(seed, kernel, threads):
    M, N, K = 40, 37, 40  # K steps of 16: the last one is ragged (dynamic slices)
    a, b, sa, sb = operands(M, N, K, torch.float16, gen=seed)
    d = torch.full((M, N), float("nan"))
    run(kernel, {0: sa, 1: sb, 2: d, 3: args(M, N, K, K, N, N, 0, 32)}, threads)
    ref = expected_block(a, b, 0, 32, 32, 5)
    torch.testing.assert_close(d[:32, 32:].double(), ref, atol=1e-4, rtol=0)


def test_store_and_iterators(seed):
    M, N, K = 32, 32, 20
    a, b, sa, sb = operands(M, N, K, torch.float16, gen=3)
    d = torch.full((M, N), float("nan"))
    run("tensor_mm_coop_store", {0: sa, 1: sb, 2: d, 3: args(M, N, K, K, N, N)})
    torch.testing.assert_close(d.double(), 2 * expected_block(a, b, 0, 0), atol=1e-4, rtol=0)


def test_a_kernel_that_hard_codes_a_layout_fails():
    # The same product as test_store_and_iterators, read back assuming one fixed layout: wrong
    # under every seed (the simulator never draws the row-major map it assumes).
    M, N, K = 32, 32, 20
    a, b, sa, sb = operands(M, N, K, torch.float16, gen=3)
    ref = expected_block(a, b, 0, 0)
    mp = pytest.MonkeyPatch()
    try:
        for s in SEEDS:
            mp.setenv("TORCH_STEEL_SIM_LAYOUT_SEED", str(s))
            d = torch.zeros(M, N)
            run("tensor_mm_coop_hardcoded", {0: sa, 1: sb, 2: d, 3: args(M, N, K, K, N, N)})
            assert not torch.allclose(d.double(), ref, atol=1e-3), f"seed {s}"
    finally:
        mp.undo()


def test_a_kernel_that_skips_is_valid_element_fails_under_some_seed():
    # Invalid slots name some real element: writing them overwrites it with garbage, or (two
    # threads writing one element) is a data race the checkers report.
    M, N, K = 32, 32, 20
    a, b, sa, sb = operands(M, N, K, torch.float16, gen=4)
    ref = expected_block(a, b, 0, 0)
    caught = 0
    mp = pytest.MonkeyPatch()
    try:
        for s in SEEDS:
            mp.setenv("TORCH_STEEL_SIM_LAYOUT_SEED", str(s))
            d = torch.zeros(M, N)
            try:
                buffers = {0: sa, 1: sb, 2: d, 3: args(M, N, K, K, N, N)}
                run("tensor_mm_coop_no_valid_check", buffers)
            except SimulatorError as e:
                assert "data race" in str(e)
                caught += 1
                continue
            caught += not torch.allclose(d.double(), ref, atol=1e-3, equal_nan=False)
    finally:
        mp.undo()
    assert caught > 0


def test_reductions_and_map_iterator(seed):
    M, N, K = 32, 32, 24
    a, b, sa, sb = operands(M, N, K, torch.float16, gen=5)
    out = torch.full((96,), float("nan"))
    by_element = torch.full((32, 32), float("nan"))
    run("tensor_reduce", {0: sa, 1: sb, 2: out, 3: args(M, N, K, K, N, N), 4: by_element})
    ref = a.double() @ b.double()
    torch.testing.assert_close(out[:32].double(), ref.sum(1), atol=1e-3, rtol=0)
    torch.testing.assert_close(out[32:64].double(), ref.amax(1), atol=1e-4, rtol=0)
    torch.testing.assert_close(out[64:].double(), ref.sum(0), atol=1e-3, rtol=0)
    rows = ref.sum(1, keepdim=True).expand(32, 32)
    torch.testing.assert_close(by_element.double(), rows, atol=1e-3, rtol=0)


def test_max_reduction_identity_defaults_to_zero():
    # Negative products: max with the default identity 0 gives 0, not the row maximum.
    M, N, K = 32, 32, 8
    a = -torch.rand(M, K).half() - 0.1
    b = torch.rand(K, N).half() + 0.1
    out = torch.zeros(96)
    run("tensor_reduce", {0: a, 1: b, 2: out, 3: args(M, N, -K, K, N, N), 4: torch.zeros(32, 32)})
    assert (out[32:64] == 0).all()


def test_cooperative_left_input(seed):
    a, b, sa, sb = operands(32, 32, 16, torch.float16, gen=6)
    d = torch.zeros(32, 32)
    run("tensor_mm_coop_left", {0: sa, 1: sb, 2: d, 3: args(32, 32, 16, 16, 32, 32)})
    torch.testing.assert_close(d.double(), expected_block(a, b, 0, 0), atol=1e-4, rtol=0)


def test_static_extent_past_the_edge_reads_poison():
    M, K = 20, 32
    a, b, sa, sb = operands(M, 32, K, torch.float16, gen=7)
    d = torch.zeros(32, 32)
    run("tensor_mm_static_edge", {0: sa, 1: sb, 2: d, 3: args(M, 32, K, K, 32, 32)})
    torch.testing.assert_close(d[:M].double(), a.double() @ b.double(), atol=1e-4, rtol=0)
    assert d[M:].isnan().all()


def test_relaxed_precision_rounds_float_operands_to_11_bits():
    K = 64
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(16, K, generator=g), torch.randn(K, 16, generator=g)
    ref = a.double() @ b.double()
    exact, relaxed = torch.zeros(16, 16), torch.zeros(16, 16)
    run("tensor_mm_f32_exact", {0: a, 1: b, 2: exact, 3: args(16, 16, K, K, 16, 16)})
    run("tensor_mm_f32_relaxed", {0: a, 1: b, 2: relaxed, 3: args(16, 16, K, K, 16, 16)})
    scale = ref.abs().max()
    err_exact = ((exact.double() - ref).abs().max() / scale).item()
    err_relaxed = ((relaxed.double() - ref).abs().max() / scale).item()
    assert err_exact < 1e-6
    assert 1e-5 < err_relaxed < 5e-3
    # Exactly the product of operands rounded to 11 significant bits (half's mantissa).
    ar = a.half().float().double()  # |x| in half's normal range: same rounding as relax()
    br = b.half().float().double()
    torch.testing.assert_close(relaxed.double(), ar @ br, atol=1e-5, rtol=1e-5)


SCOPE_FAULTS = {
    1: "16 of the threadgroup's 64 threads|32 of the threadgroup's 64 threads",  # others exit
    2: "missing|exited",
    3: "different",
    4: "passes another tensor",
}


@pytest.mark.parametrize("fault", sorted(SCOPE_FAULTS))
def test_scope_errors(fault):
    buffers = {
        0: torch.zeros(32, 16).half(),
        1: torch.zeros(16, 32).half(),
        2: torch.zeros(32, 32),
        3: args(32, 32, fault, 16, 32, 32),
    }
    with pytest.raises(SimulatorError, match=SCOPE_FAULTS[fault]):
        run("tensor_mm_scope", buffers, 64)


def test_scope_uniform_call_passes_and_wrong_simdgroup_count_is_an_error():
    buffers = {
        0: torch.zeros(32, 16).half(),
        1: torch.zeros(16, 32).half(),
        2: torch.zeros(32, 32),
        3: args(32, 32, 0, 16, 32, 32),
    }
    run("tensor_mm_scope", buffers, 64)
    with pytest.raises(SimulatorError, match=r"execution_simdgroups<2> in a threadgroup of 96"):
        run("tensor_mm_scope", buffers, 96)


def test_int32_offsets_wrap():
    # Row 2 of a tensor with a row stride of 2^30 elements is 2^31 elements away: the int32
    # offset wraps, the address is outside every buffer.
    with pytest.raises(SimulatorError):
        run("tensor_offset_wrap", {0: torch.zeros(256).half(), 2: torch.zeros(16, 16)})


COMPILE_RULES = {
    "m_n_not_multiple_of_16": (
        "matmul2d<matmul2d_descriptor(8, 8), execution_simdgroup> op; op.run(ta, tb, td);",
        "m or n must be a multiple of 16",
    ),
    "static_extent_disagrees": (
        "matmul2d<matmul2d_descriptor(16, 16, 16), execution_simdgroup> op;"
        " op.run(ta.slice<32, 16>(0, 0), tb, td);",
        "static extent .dimension 0. disagrees",
    ),
    "read_only_destination": (
        "matmul2d<matmul2d_descriptor(16, 16), execution_simdgroup> op; op.run(ta, tb, ta);",
        "destination tensor is read-only",
    ),
    "msl3_has_no_tensors": (None, "needs MSL 4"),
}


def test_language_version_follows_what_the_file_uses(tmp_path):
    """Issue 26 finding 10: a file that includes <metal_tensor> under any name is MSL 4 (as it
    must be built on the Mac), unless -std says otherwise (test_compile_time_rules)."""
    from torch_steel import sim

    src = tmp_path / "tensor_version.metal"
    src.write_text(
        "#include <metal_stdlib>\n#include <metal_tensor>\nusing namespace metal;\n"
        "[[kernel]] void tensor_version(device int* out [[buffer(0)]]) {\n"
        "#if __METAL_VERSION__ >= 400 && __HAVE_TENSOR__\n  out[0] = __METAL_VERSION__;\n"
        "#endif\n}\n"
    )
    out = torch.zeros(1, dtype=torch.int32)
    sim.run_kernel("tensor_version", sources=[src], grid=(1,), threads=(1,), buffers={0: out})
    assert out.item() == 400


@pytest.mark.parametrize("rule", sorted(COMPILE_RULES))
def test_compile_time_rules(rule, tmp_path):
    from torch_steel import sim

    body, message = COMPILE_RULES[rule]
    name = "refused.metal" if body is None else "refused_msl4.metal"
    std = "metal3.1" if body is None else None  # MSL 3.1 has no <metal_tensor>
    src = tmp_path / name
    src.write_text(
        textwrap.dedent(
            """\
            #include <metal_stdlib>
            #include <metal_tensor>
            #include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
            using namespace metal;
            using namespace mpp::tensor_ops;
            using In = tensor<const device half, dextents<int32_t, 2>, tensor_inline>;
            using Out = tensor<device float, dextents<int32_t, 2>, tensor_inline>;
            [[kernel]] void refused(const device half* a [[buffer(0)]],
                                    device float* d [[buffer(1)]]) {
              In ta(a, dextents<int32_t, 2>(16, 16));
              In tb(a, dextents<int32_t, 2>(16, 16));
              Out td(d, dextents<int32_t, 2>(16, 16));
              BODY
            }
            """
        ).replace("BODY", body or "")
    )
    with pytest.raises(SimulatorError, match=message):
        sim.run_kernel("refused", sources=[src], grid=(1,), threads=(32,), buffers={}, std=std)


@pytest.mark.parametrize("kl, kr", [(48, 12), (12, 48), (31, 31)])
def test_dynamic_k_with_differing_operand_extents(kl, kr):
    # P x V on a ragged last tile: the left's K extent is the tile's, the right's the rows left
    # (or the other way). K is the larger extent and each operand reads zeros past its own, so
    # the product is over the smaller one.
    M, N = 32, 32
    g = torch.Generator().manual_seed(kl * 100 + kr)
    a = torch.randn(M, kl, generator=g).half()
    b = torch.randn(kr, N, generator=g).half()
    d = torch.full((M, N), -7.0)
    c = run(
        "tensor_mm_ragged_k",
        {0: a, 1: b, 2: d, 3: struct.pack("4i", M, N, kl, kr)},
        counters=True,
    )
    k = min(kl, kr)
    ref = a[:, :k].double() @ b[:k].double()
    # half operands, products and sums in binary32 over at most 48 terms of size ~1: 1e-4.
    torch.testing.assert_close(d.double(), ref, atol=1e-4, rtol=1e-4)
    assert c["tensor_multiply_adds"] == M * N * max(kl, kr)
