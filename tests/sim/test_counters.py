"""The simulator's counters, exact on small kernels (kernels: tests/sim/kernels/exec_counters.metal)
and on the GEMM plan."""

import re
import struct
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel import sim
from torch_steel.sim import ir

KERNELS = Path(__file__).parent / "kernels"
SRC = [KERNELS / "exec_counters.metal"]
ROOT = Path(__file__).resolve().parents[2]


pytestmark = requires_clang


def run(name, **kw):
    return sim.run_kernel(name, sources=SRC, counters=True, **kw)


@pytest.mark.parametrize(
    ("kernel", "dtype"), [("exec_copy_float", torch.float32), ("exec_copy_half", torch.float16)]
)
def test_bytes_read_and_written_per_buffer(kernel, dtype):
    count = 100
    x = torch.randn(128).to(dtype)
    out = torch.zeros(128, dtype=dtype)
    c = run(kernel, grid=(4,), threads=(32,), buffers={0: x, 1: out, 2: struct.pack("<I", count)})
    assert torch.equal(out[:count], x[:count])
    size = x.element_size()
    assert c["kernel"] == kernel
    assert c["threadgroups"] == 4
    assert c["lanes"] == 128
    assert c["buffers"][0] == {"read": count * size, "written": 0}
    assert c["buffers"][1] == {"read": 0, "written": count * size}
    # `count` is read by every thread.
    assert c["buffers"][2] == {"read": 128 * 4, "written": 0}
    assert c["mma"] == 0
    assert c["simd_ops"] == 0


def test_simd_ops_per_simdgroup():
    rounds = 5
    out = torch.zeros(3 * 96)
    c = run(
        "exec_simd_rounds", grid=(3,), threads=(96,), buffers={0: out, 1: struct.pack("<I", rounds)}
    )
    assert torch.equal(out, torch.ones(3 * 96))
    assert c["simd_ops"] == rounds * 3 * 3  # rounds x simdgroups per threadgroup x threadgroups
    assert c["mma"] == 0


def test_mma_count_is_one_per_simdgroup_operation():
    rounds = 3
    a = torch.eye(8).flatten()
    c_out = torch.zeros(4 * 64)
    c = run(
        "exec_mma_rounds",
        grid=(2,),
        threads=(64,),
        buffers={0: a, 1: c_out, 2: struct.pack("<I", rounds)},
    )
    # C = sum of `rounds` products I @ I, one per simdgroup.
    assert torch.equal(c_out.view(4, 8, 8), torch.eye(8).expand(4, 8, 8) * rounds)
    assert c["mma"] == rounds * 2 * 2  # rounds x simdgroups x threadgroups
    assert c["threadgroups"] == 2
    assert c["simd_ops"] >= c["mma"]


def _gemm_ready() -> str | None:
    p = sim.plan("gemm", [torch.zeros(64, 64), torch.zeros(64, 64), None, None], {})
    if not p.ok:
        return f"the gemm plan refuses 64x64x64 float32: {p.reason}"
    lib = sim.build.shader_library()
    missing = [d.kernel for d in p.dispatches if d.kernel not in lib.handle.kernels()]
    if missing:
        return f"gemm kernels {missing} did not build in the simulator: {lib.errors[:500]}"
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemm_counters(dtype):
    reason = _gemm_ready()
    if reason is not None:
        pytest.skip(reason)
    m = n = k = 64
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    (out,), counters = sim.run_op("gemm", [a, b, None, None], {}, counters=True)
    ref = a.double() @ b.double()
    assert torch.allclose(out.double(), ref, rtol=1e-2, atol=1e-2)  # fp16 output rounding
    total_mma = sum(c["mma"] for c in counters)
    # Aligned shapes: each 8x8x8 block product is computed exactly once.
    assert total_mma == (m // 8) * (n // 8) * (k // 8)
    written = sum(b_["written"] for c in counters for b_ in c["buffers"].values())
    assert written >= m * n * a.element_size()


def test_attention_shaped_kernel_numerics_and_counters():
    queries, keys, dim = 32, 48, 64
    q, k, v = (torch.randn(n, dim) for n in (queries, keys, keys))
    o = torch.zeros(queries, dim)
    c = sim.run_kernel(
        "exec_attention_d64",
        sources=[KERNELS / "exec_attention.metal"],
        grid=(queries // 8,),
        threads=(32,),
        counters=True,
        buffers={
            0: q,
            1: k,
            2: v,
            3: o,
            4: struct.pack("<I", keys),
            5: struct.pack("<f", dim**-0.5),
        },
    )
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double()[None], k.double()[None], v.double()[None]
    )[0]
    # float32 throughout; exp and the online rescaling each add a few ulp.
    assert torch.allclose(o.double(), ref, rtol=1e-5, atol=1e-5)
    blocks = keys // 8
    # Per simdgroup and key block: 8 MMAs for Q K^T and 8 for P V.
    assert c["mma"] == (queries // 8) * blocks * 16
    # Q, K, V read from device memory: Q once, K and V once per query block.
    assert c["buffers"][0]["read"] == q.numel() * 4
    assert c["buffers"][1]["read"] == (queries // 8) * k.numel() * 4
    assert c["buffers"][3] == {"read": 0, "written": o.numel() * 4}


def tg_and_simd_traffic():
    """Counters of exec_tg_and_simd_traffic on 3 threadgroups of 128 threads."""
    return sim.run_kernel(
        "exec_tg_and_simd_traffic",
        sources=SRC,
        grid=(3,),
        threads=(128,),
        buffers={0: torch.zeros(128)},
        counters=True,
        checkers=False,  # the three threadgroups write the same output: not what is measured
    )


def test_threadgroup_bytes_and_simd_kinds():
    c = tg_and_simd_traffic()
    assert c["threadgroup_written"] == 3 * 128 * 4
    assert c["threadgroup_read"] == 3 * 128 * 4
    simdgroups = 3 * 4
    assert c["shuffles"] == simdgroups
    assert c["reductions"] == 2 * simdgroups
    assert c["ballots"] == simdgroups
    assert c["simd_ops"] == 4 * simdgroups


# ------------------------------------------------------------------ instruction counters
#
# Counts per simdgroup, derived by hand from each kernel (exec_counters.metal) as clang compiles
# it: `i` is a uint thread position, so each device access costs a zext to 64 bits (once per
# kernel, reused) and a getelementptr with that variable index (both "int").

CLASSES = ("fp32", "half", "transcendental", "convert", "int", "compare_select", "branch", "other")


def mix(**counts):
    return {k: counts.get(k, 0) for k in CLASSES}


def run_mix(name, simdgroups=1, **kw):
    c = run(name, grid=(1,), threads=(32 * simdgroups,), **kw)
    memory = {
        k: c[k]
        for k in (
            "device_loads",
            "device_stores",
            "threadgroup_loads",
            "threadgroup_stores",
            "constant_read",
        )
    }
    return c, memory


def memory(device_loads=0, device_stores=0, threadgroup_loads=0, threadgroup_stores=0, const=0):
    return {
        "device_loads": device_loads,
        "device_stores": device_stores,
        "threadgroup_loads": threadgroup_loads,
        "threadgroup_stores": threadgroup_stores,
        "constant_read": const,
    }


@pytest.mark.parametrize("simdgroups", [1, 3])
def test_instructions_fp32(simdgroups):
    x = torch.randn(32 * simdgroups)
    want = x * 3 + 1
    c, mem = run_mix("exec_mix_fp32", simdgroups, buffers={0: x})
    assert torch.equal(x, want)
    # x * 3 + 1: one FMA (the multiply's one use is the add: contracted); the zext of i and one
    # address; one load, one store.
    assert c["instructions"] == mix(fp32=simdgroups, int=2 * simdgroups)
    assert mem == memory(device_loads=simdgroups, device_stores=simdgroups)
    assert c["mma_by_dtype"] == {"half": 0, "bfloat": 0, "float": 0}


def test_instructions_vector_ops_count_per_element():
    x = torch.randn(32 * 4)
    c, mem = run_mix("exec_mix_float4", buffers={0: x})
    # A float4 multiply and add: 4 FMAs; one 16-byte load and store.
    assert c["instructions"] == mix(fp32=4, int=2)
    assert mem == memory(device_loads=1, device_stores=1)


def test_instructions_half_math_is_one_instruction_of_its_class():
    x = torch.rand(32).half()
    want = torch.exp(x.float() * 3).half()
    c, _ = run_mix("exec_mix_half", buffers={0: x})
    # half exp is within 1 ulp of half in Metal (the shim: binary32, rounded once).
    assert torch.allclose(x.float(), want.float(), rtol=2e-3, atol=0)
    # The half multiply, then exp: one transcendental; the shim's binary32 detour (two
    # conversions, a libm call) is not counted.
    assert c["instructions"] == mix(half=1, transcendental=1, int=2)


def test_instructions_conversions_compare_select():
    h = torch.randn(32).half()
    f = torch.randn(32, 4) * 100
    out = torch.zeros(32)
    iout = torch.zeros(32, 4, dtype=torch.int32)
    c, mem = run_mix("exec_mix_convert", buffers={0: h, 1: f, 2: out, 3: iout})
    assert torch.equal(out, torch.where(h.float() > 0.5, h.float(), torch.tensor(2.0)))
    assert torch.equal(iout, f.trunc().to(torch.int32))
    # float(h): 1 conversion; int4(f): 4 (the shim's range checks before them do not count);
    # a > 0.5f ? a : 2: a compare and a select; the zext and four addresses.
    assert c["instructions"] == mix(convert=5, compare_select=2, int=5)
    assert mem == memory(device_loads=2, device_stores=2)


def test_instructions_reductions_issue_no_alu():
    """A simd reduction is one operation of its own (the reductions counter), not the shim's
    fold over the lanes: simd_max and simd_min once counted 31 max instructions per call,
    through the marker of the metal::max they folded with."""
    x = torch.randn(32)
    h = x.half().float()
    want = x.max() + x.min() + x.sum()
    want_h = (h.max().half() + h.min().half() + h.half().sum(dtype=torch.float32).half()).float()
    out = x.clone()
    c, mem = run_mix("exec_mix_reductions", buffers={0: out})
    # The half sum runs in half precision lane by lane: 32 roundings of at most 2^-11 of a
    # partial sum, each under sum |x|.
    assert bool(((out - (want + want_h)).abs() <= 32 * 2.0**-11 * float(x.abs().sum())).all())
    assert c["reductions"] == 6
    # fp32: 2 adds; half: 2 adds; conversions: float to half once, the half sum back once;
    # the zext and one address.
    assert c["instructions"] == mix(fp32=3, half=2, convert=2, int=2)
    assert mem == memory(device_loads=1, device_stores=1)


def test_instructions_transcendentals():
    x = torch.rand(32) + 1
    v = torch.rand(32, 4) + 1
    want_x = torch.exp2(x) * 2 + torch.rsqrt(x) / x
    want_v = torch.log(v)
    c, _ = run_mix("exec_mix_transcendental", buffers={0: x, 1: v})
    assert torch.allclose(x, want_x, rtol=1e-6)  # each correctly rounded or within a few ulp
    assert torch.allclose(v, want_v, rtol=1e-6, atol=1e-7)
    # exp2, fast::exp2, rsqrt, the divide, log of a float4 (4): 8; two adds; the zext and two
    # addresses.
    assert c["instructions"] == mix(transcendental=8, fp32=2, int=3)


@pytest.mark.parametrize("trips", [[0] * 32, [3] * 32, [0] * 31 + [5]])
def test_instructions_fma_contraction(trips):
    """Metal contracts a multiply into the add or subtract that is its one use (fast math); the
    simulator's build does not (-ffp-contract=off), and the counters count as Metal issues."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 8, generator=g)
    h = torch.randn(32, 4, generator=g).half()
    a, b, c_, d = x[:, 0].clone(), x[:, 1].clone(), x[:, 2].clone(), x[:, 3].clone()
    want_h = h[:, 0] * h[:, 1] + h[:, 2]  # each op rounded to half, as the kernel's
    trips_t = torch.tensor(trips, dtype=torch.int32)
    c, mem = run_mix("exec_mix_contract", buffers={0: x, 1: h, 2: trips_t})
    # float32 with one rounding per operation, as the simulator computes (no contraction).
    want = [a * b + c_, a * c_ - d, d - b * c_, a * d + b * b, c_ * d + a, c_ * d * b]
    for k, w in enumerate(want):
        assert torch.equal(x[:, k], w), k
    acc = torch.zeros(32)
    for lane, n in enumerate(trips):
        for _ in range(n):
            acc[lane] += a[lane] * a[lane]
    assert torch.equal(x[:, 6], acc)
    assert torch.equal(h[:, 3], want_h)
    most = max(trips)
    # By hand: a*b + c, a*c - d, d - b*c: one FMA each; a*d + b*b: an FMA and a multiply (an add
    # takes one); p = c*d used twice: multiply, add, multiply; q = a*a before the loop, its add
    # in the loop's block: a multiply, then one add per trip of the lane with the most. Half:
    # one FMA. Without contraction the float32 count would be 13 + most, half 2.
    assert c["instructions"]["fp32"] == 1 + 1 + 1 + 2 + 3 + 1 + most
    assert c["instructions"]["half"] == 1
    # The loop: trips == 0 once, then k + 1 == n and the branch back per trip.
    assert c["instructions"]["compare_select"] == 1 + most
    assert c["instructions"]["branch"] == 1 + most
    assert c["instructions"]["transcendental"] == c["instructions"]["convert"] == 0


@pytest.mark.parametrize(
    ("mask", "exp2_path", "multiply_path"),
    [(0xFFFFFFFF, 1, 0), (0, 0, 1), (0x55555555, 1, 1), (1 << 31, 1, 1)],
)
def test_instructions_divergent_paths_both_count(mask, exp2_path, multiply_path):
    x = torch.randn(32)
    y = torch.randn(32)
    lanes = torch.arange(32)
    taken = ((mask >> lanes) & 1).bool()
    want_x = torch.where(taken, torch.exp2(x), x)
    want_y = torch.where(taken, y, y * 3)
    c, mem = run_mix("exec_mix_divergent", buffers={0: x, 1: y, 2: struct.pack("<I", mask)})
    assert torch.allclose(x, want_x, rtol=1e-6) and torch.equal(y, want_y)
    # Both paths: the test (mask >> lane, & 1, the zext of i: 3 int, a compare, a branch), the
    # mask read from constant memory (4 bytes a lane); each path taken by any lane once: exp2,
    # its address, load and store; or the multiply, its address, load and store.
    paths = exp2_path + multiply_path
    assert c["instructions"] == mix(
        transcendental=exp2_path,
        fp32=multiply_path,
        int=3 + paths,
        compare_select=1,
        branch=1,
    )
    assert mem == memory(device_loads=1 + paths, device_stores=paths, const=32 * 4)
    assert c["buffers"][2]["read"] == 32 * 4  # buffers keep counting constant reads too


@pytest.mark.parametrize(
    "trips",
    [
        [0] * 32,
        [5] * 32,
        list(range(32)),  # the max (31) issues, not the sum (496)
        [0] * 31 + [7],  # one lane alone
    ],
)
def test_instructions_loop_counts_the_longest_lane(trips):
    x = torch.randn(32)
    want = x.clone()
    for lane, n in enumerate(trips):
        for _ in range(n):
            want[lane] = want[lane] * 1.5 + 1  # float32 throughout, as the kernel
    c, mem = run_mix("exec_mix_loop", buffers={0: x, 1: torch.tensor(trips, dtype=torch.int32)})
    assert torch.equal(x, want)
    most = max(trips)
    # Before the loop: the zext and two addresses, trips == 0 (compare, branch); each trip of the
    # (not unrolled) body: multiply and add (one FMA), k + 1, k == n, branch back.
    assert c["instructions"] == mix(
        fp32=most, int=3 + most, compare_select=1 + most, branch=1 + most
    )
    assert mem == memory(device_loads=2, device_stores=1)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("float", torch.float32), ("half", torch.float16), ("bfloat", torch.bfloat16)],
)
def test_mma_by_dtype(name, dtype):
    a = torch.eye(8).flatten().to(dtype)
    c_out = torch.zeros(2 * 64)
    c, mem = run_mix(f"exec_mma_types_{name}", 2, buffers={0: a, 1: c_out})
    assert torch.equal(c_out.view(2, 8, 8), torch.eye(8).expand(2, 8, 8))
    want = {"half": 0, "bfloat": 0, "float": 0}
    want[name] = 2  # one per simdgroup
    assert c["mma_by_dtype"] == want
    assert sum(c["mma_by_dtype"].values()) == c["mma"]
    # simdgroup_load and simdgroup_store: one device access each per simdgroup.
    assert mem == memory(device_loads=2, device_stores=2)


def test_threadgroup_and_constant_accesses():
    c = tg_and_simd_traffic()
    simdgroups = 3 * 4
    # Per simdgroup one threadgroup store, one threadgroup load, one device store.
    assert c["threadgroup_stores"] == simdgroups
    assert c["threadgroup_loads"] == simdgroups
    assert c["device_stores"] == simdgroups
    assert c["device_loads"] == 0
    assert c["constant_read"] == 0
    # The simd operations are counted as such, not as instructions.
    assert c["instructions"]["other"] == 0


def test_constant_read_is_the_constant_parameters_bytes():
    x = torch.randn(128)
    out = torch.zeros(128)
    c = run(
        "exec_copy_float",
        grid=(4,),
        threads=(32,),
        buffers={0: x, 1: out, 2: struct.pack("<I", 100)},
    )
    assert c["constant_read"] == c["buffers"][2]["read"] == 128 * 4
    # Per simdgroup: count (constant) and in[gid] (in the if) loaded, out[gid] stored.
    assert c["device_loads"] == 4 * 2
    assert c["device_stores"] == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_attention_forward_transcendentals(dtype, causal):
    """Steel's prefill forward (shaders/steel/attn/forward.h, softmax.h): exactly one exp2 per
    score of each key tile a simdgroup visits plus one per row for the correction factor, and one
    divide (1 / l) and one log (the lse) per simdgroup that holds a query row."""
    B, H, L, S, D = 1, 2, 39, 33, 64  # L % 32 == 7, S % 32 == 1
    q, k, v = (torch.randn(B, H, n, D).to(dtype) for n in (L, S, S))
    options = {"is_causal": True} if causal else {}
    (out, _), counters = sim.run_op("sdpa", [q, k, v, None, None], options, counters=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=causal
    )
    # fp16 inputs and output (about 1e-3 relative), fp32 accumulation.
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    assert torch.allclose(out.double(), ref, rtol=tol, atol=tol)
    (c,) = counters
    # The kernel's tiles (shaders/steel/params.h): BQ = 32 query rows = 4 simdgroups of 8 rows;
    # d64 takes BK = 32 keys in f32 and f16 (K and V tiles fit the 20 KiB budget separately).
    bq, simdgroups, bk = 32, 4, 32
    assert c["threadgroups"] == H * -(-L // bq)
    expected = 0
    for block in range(-(-L // bq)):
        row0 = block * bq
        last_row = min(row0 + bq, L) - 1
        key_end = min(S, last_row + 1) if causal else S  # forward.h, attn_key_tiles
        tiles = -(-key_end // bk)
        # OnlineSoftmax::update per tile: each lane's 2 * BK / 8 scores and the row's factor
        # (the four lanes of a row issue it together): 2 * BK / 8 + 1 issues per simdgroup, which
        # over its 32 lanes is one exp2 per score of the 8 x BK tile plus one per row.
        per_tile = 2 * (bk // 8) + 1
        expected += simdgroups * tiles * per_tile
        # inverse_sum (1 / l) and lse (log l), by simdgroups with a row < L.
        expected += 2 * -(-(last_row + 1 - row0) // 8)
    assert c["instructions"]["transcendental"] == H * expected
    # Q and K fragments are held in the inputs' type (forward.h, AttnOperandRow), so S = Q K^T
    # runs on half operands into the fp32 accumulator; P is fp32, so O += P V runs float MMAs
    # (V converted on its way in). With D == Dv the two products take as many MMAs each.
    qk = "float" if dtype == torch.float32 else "half"
    want = {"half": 0, "bfloat": 0, "float": 0}
    want[qk] += c["mma"] // 2
    want["float"] += c["mma"] // 2
    assert c["mma_by_dtype"] == want
    assert c["mma"] > 0 and c["mma"] % 2 == 0
    # The params struct (setBytes, [[buffer(7)]]) is the one constant-space parameter.
    assert c["constant_read"] == c["buffers"][7]["read"] > 0


def test_threadgroup_array_declaration_issues_nothing():
    """A threadgroup array costs the same instructions in a kernel of a short and of a long name
    (the simulator's per-instantiation bookkeeping, a hash of the function's name, once counted
    3 integer ops, a compare and a branch per character per simdgroup)."""
    counts = []
    for name in (
        "exec_tg_name",
        "exec_tg_name_that_is_a_good_deal_longer_than_the_other_one_so_that_a_cost_per_"
        "character_of_the_function_name_would_show_in_every_class_of_the_instruction_counters",
    ):
        out = torch.zeros(64)
        c = run(name, grid=(1,), threads=(32,), buffers={0: out})
        assert torch.equal(out[:32], torch.arange(31, -1, -1, dtype=torch.float32))
        counts.append(c["instructions"])
    assert counts[0] == counts[1]


def _copy_counts(name, buffers=None):
    out = torch.zeros(32)
    c = run(name, grid=(1,), threads=(32,), buffers={0: out, **(buffers or {})})
    keys = ("device_loads", "device_stores", "threadgroup_loads", "threadgroup_stores")
    return out, {k: c[k] for k in keys}


def test_copies_across_address_spaces_count_as_their_loads():
    """A local copy-initialized from threadgroup memory is the threadgroup load that the plain
    assignment is (the shim's byte copy once read through a generic pointer: no load counted),
    and a struct copied from device into threadgroup memory and back out is one load and one
    store of each space (8-byte struct: one access each)."""
    out_init, init = _copy_counts("exec_copy_init_vec_float")
    out_assign, assign = _copy_counts("exec_assign_vec_float")
    expected = torch.arange(31, -1, -1, dtype=torch.float32) + 1
    assert torch.equal(out_init, expected) and torch.equal(out_assign, expected)
    assert (
        init
        == assign
        == {
            "device_loads": 0,
            "device_stores": 1,
            "threadgroup_loads": 1,
            "threadgroup_stores": 1,
        }
    )
    pairs = torch.arange(64, dtype=torch.float32)  # 32 structs (a, b) = (2j, 2j + 1)
    out, struct_copy = _copy_counts("exec_copy_struct", {1: pairs})
    assert torch.equal(out, (pairs[0::2] + pairs[1::2]).flip(0))
    assert struct_copy == {
        "device_loads": 1,
        "device_stores": 1,
        "threadgroup_loads": 1,
        "threadgroup_stores": 1,
    }


@pytest.mark.parametrize("fixed", [True, False])
def test_instructions_function_constant_select_is_resolved(fixed):
    """A select on a function constant and an i1 or with one are resolved when Metal builds the
    pipeline: the kernel counts what its twin without the function constant counts (each once
    counted a compare-select: 2 a key in the vector decode kernel's loops)."""
    x0 = torch.randn(32)
    x, twin = x0.clone(), x0.clone()
    scale = struct.pack("<f", 3.0)
    c, _ = run_mix("exec_mix_constant_select", buffers={0: x, 1: scale}, constants={0: fixed})
    t, _ = run_mix("exec_mix_runtime_select", buffers={0: twin, 1: scale})
    assert torch.equal(x, x0 * 2 if fixed else torch.where(x0 > 0, x0 * 3, 0.0))
    assert torch.equal(twin, torch.where(x0 > 0, x0 * 3, 0.0))
    # a * s: one multiply; a > 0 ? b : 0: a compare and a select; the zext and one address.
    assert c["instructions"] == t["instructions"] == mix(fp32=1, int=2, compare_select=2)


def test_instructions_shuffle_source_lane_check_is_the_simulators():
    """simd_shuffle by a loop's index in two slots a runtime flag each may skip: per trip, each
    slot's FMA and flag branch and the loop's increment, zext (the ushort index against the uint
    bound), compare and branch. The shim's check of the source lane once counted 5 integer
    operations and 3 compares more a trip: the optimizer hoisted it out of the shim's lines."""
    counts = []
    for trips in (1, 5):
        x0 = torch.randn(32)
        x = x0.clone()
        c, _ = run_mix(
            "exec_mix_shuffle_loop",
            buffers={0: x, 1: struct.pack("<I", trips), 2: struct.pack("<II", 1, 1)},
        )
        want = x0 * (x0[:trips].sum() + (x0[:trips] + 1).sum())
        assert torch.allclose(x, want, rtol=1e-5, atol=1e-5)
        assert c["shuffles"] == 2 * trips
        counts.append(c["instructions"])
    per_trip = {k: (counts[1][k] - counts[0][k]) / 4 for k in CLASSES}
    assert per_trip == mix(fp32=2, int=2, compare_select=1, branch=3)


def _block_histogram(body):
    """The instruction classes count_blocks gives the one block of an IR function."""
    text = f"define void @f(ptr addrspace(1) %p, ptr addrspace(1) %o) {{\n{body}\n}}\n"
    out = ir.count_blocks(text)
    table = re.search(r"@steel_sim\.block\.0 = private constant \[\d+ x i32\] \[(.*)\]", out)
    values = [int(v.split()[1]) for v in table.group(1).split(",")]
    return dict(zip(ir.FIELDS, values))


def test_instructions_element_reads_of_a_packed_load_are_moves():
    """clang reads the two halves of a half2 as one 32-bit load, a shift, truncations to 16 bits
    and bitcasts to half (as it compiled the vector decode kernel's K and V rows): element
    moves, not integer instructions (6 a key counted in that kernel). A shift whose value is
    used as an integer still counts."""
    moves = """
  %x = load i32, ptr addrspace(1) %p, align 4
  %a = trunc i32 %x to i16
  %ah = bitcast i16 %a to half
  %af = fpext half %ah to float
  %s = lshr i32 %x, 16
  %b = trunc nuw i32 %s to i16
  %bh = bitcast i16 %b to half
  %bf = fpext half %bh to float
  %m = fmul float %af, %bf
  store float %m, ptr addrspace(1) %o, align 4
  ret void"""
    h = _block_histogram(moves)
    assert (h["int"], h["convert"], h["fp32"], h["device_loads"], h["device_stores"]) == (
        0, 2, 1, 1, 1,
    )  # fmt: skip
    arithmetic = """
  %x = load i32, ptr addrspace(1) %p, align 4
  %s = lshr i32 %x, 16
  %b = trunc i32 %s to i16
  %bh = bitcast i16 %b to half
  %bf = fpext half %bh to float
  %n = add i32 %s, 1
  store i32 %n, ptr addrspace(1) %o, align 4
  ret void"""
    h = _block_histogram(arithmetic)
    assert (h["int"], h["convert"]) == (2, 1)  # the shift (an add uses it) and the add
    # A shift off an element's boundary, or into a float bitcast without its truncation, is
    # integer arithmetic on the bits, not an element read.
    for unaligned in ("%b = trunc i32 %s to i16\n  %bh = bitcast i16 %b to half",
                      "%bh = bitcast i32 %s to float"):  # fmt: skip
        shift = 8 if "half" in unaligned else 16
        h = _block_histogram(f"""
  %x = load i32, ptr addrspace(1) %p, align 4
  %s = lshr i32 %x, {shift}
  {unaligned}
  store {"half" if "half" in unaligned else "float"} %bh, ptr addrspace(1) %o, align 4
  ret void""")
        assert h["int"] == 1, unaligned
