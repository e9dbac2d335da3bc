"""The simulator's counters, exact on small kernels (kernels: tests/sim/kernels/exec_counters.metal)
and on the GEMM plan."""

import struct
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel import sim

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


def test_threadgroup_bytes_and_simd_kinds():
    c = sim.run_kernel(
        "exec_tg_and_simd_traffic",
        sources=SRC,
        grid=(3,),
        threads=(128,),
        buffers={0: torch.zeros(128)},
        counters=True,
        checkers=False,  # the three threadgroups write the same output: not what is measured
    )
    assert c["threadgroup_written"] == 3 * 128 * 4
    assert c["threadgroup_read"] == 3 * 128 * 4
    simdgroups = 3 * 4
    assert c["shuffles"] == simdgroups
    assert c["reductions"] == 2 * simdgroups
    assert c["ballots"] == simdgroups
    assert c["simd_ops"] == 4 * simdgroups
