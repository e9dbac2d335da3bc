"""Executing launch plans through torch_steel.sim: plan(), run_op() bindings, refusals."""

import math
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel import sim
from torch_steel.errors import PlanRefused

ROOT = Path(__file__).resolve().parents[2]


pytestmark = requires_clang


def _gemm_ready() -> str | None:
    p = sim.plan("gemm", [torch.zeros(64, 64), torch.zeros(64, 64), None, None], {})
    if not p.ok:
        return f"the gemm plan refuses 64x64x64 float32: {p.reason}"
    kernels = sim.build.shader_library().handle.kernels()
    if any(d.kernel not in kernels for d in p.dispatches):
        return "the gemm kernels did not build in the simulator"
    return None


@pytest.fixture
def gemm_ready():
    reason = _gemm_ready()
    if reason is not None:
        pytest.skip(f"gemm (issue 4) is not ready in the simulator: {reason}")


def test_unknown_op_is_refused_with_a_reason():
    p = sim.plan("no_such_op", [torch.zeros(2)], {})
    assert not p.ok and "no_such_op" in p.reason
    with pytest.raises(PlanRefused, match="no_such_op"):
        sim.run_op("no_such_op", [torch.zeros(2)], {})


def test_unsupported_dtype_is_refused():
    a = torch.zeros(8, 8, dtype=torch.float64)
    with pytest.raises(PlanRefused, match="float64"):
        sim.run_op("gemm", [a, a, None, None], {})


def test_bad_option_type_is_a_clear_error():
    with pytest.raises(TypeError, match="alpha"):
        sim.plan("gemm", [torch.zeros(8, 8), torch.zeros(8, 8), None, None], {"alpha": [1]})


def test_plan_mirrors_plan_h(gemm_ready):
    a, b = torch.zeros(64, 32), torch.zeros(32, 48)
    p = sim.plan("gemm", [a, b, None, None], {"alpha": 2.0, "activation": "relu"})
    assert p.ok and p.reason == "" and p.inputs == 4
    outputs = [x for x in p.allocations if x.is_output]
    assert len(outputs) == 1 and outputs[0].sizes == (64, 48)
    assert outputs[0].dtype == torch.float32
    for d in p.dispatches:
        assert isinstance(d.kernel, str) and d.kernel
        assert len(d.grid) == 3 and len(d.threads) == 3
        assert all(isinstance(i, int) for i in d.constants)
        for bnd in d.bindings:
            assert bnd.kind in ("tensor", "bytes")
            assert (bnd.kind == "tensor") == (bnd.slot >= 0)


def test_views_are_bound_at_their_storage_offset(gemm_ready):
    # a: a transposed view, b: a slice with a storage offset; the plan either binds them in
    # place or asks for contiguous copies, and the result must be right either way.
    torch.manual_seed(0)
    big = torch.randn(200, 40)
    a = torch.randn(24, 32).t()  # [32, 24], strides (1, 32)
    b = big[7:31, 3:35]  # [24, 32], offset 7*40+3
    (out,), counters = sim.run_op("gemm", [a, b, None, None], {}, counters=True)
    ref = a.double() @ b.double()
    # float32 inputs, fp32 accumulation over K = 24: a few ulp of the largest partial sums.
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert all(
        {"kernel", "threadgroups", "mma", "simd_ops", "buffers"} <= c.keys() for c in counters
    )


def test_outputs_are_fresh_tensors_and_inputs_untouched(gemm_ready):
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    a0, b0 = a.clone(), b.clone()
    out1 = sim.run_op("gemm", [a, b, None, None], {})[0]
    out2 = sim.run_op("gemm", [a, b, None, None], {})[0]
    assert out1.data_ptr() != out2.data_ptr()
    assert torch.equal(out1, out2)
    assert torch.equal(a, a0) and torch.equal(b, b0)
    assert not any(math.isnan(v) for v in out1.flatten().tolist())
