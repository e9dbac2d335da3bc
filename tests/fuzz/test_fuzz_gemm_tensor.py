"""Property-based differential tests of steel::gemm on Metal 4's matmul2d
(shaders/steel/gemm_tensor, planned by mps_src/plan/gemm_plan.cpp for an M5-generation device
only) in the Metal simulator emulating such a device, checkers on.

The calls are strategies.gemm_calls() in float16 and bfloat16 (the tensor-op kernels' dtypes),
the device described as Metal 4 + Apple10 with the tensor-op library, and the cooperative
tensors' element-to-lane layouts drawn per call (TORCH_STEEL_SIM_LAYOUT_SEED from the call's
seed), so that a kernel relying on one layout fails some draw. The kernel agrees with float64
math within gemm_helpers.assert_close's bound and no guard byte changed.
"""

from __future__ import annotations

import os

import torch
from fuzz_helpers import fixed, fuzz, fuzz_mark, requires_simulator
from gemm_helpers import M5
from hypothesis import assume, given
from strategies import gemm_calls
from test_fuzz_gemm import check_result

from torch_steel import sim

pytestmark = requires_simulator

HALF = (torch.float16, torch.bfloat16)


def check_gemm_tensor(call):
    t, guards = call.build()
    tensors = [t["a"], t["b"], t["bias"], t["c"]]
    options = {"alpha": call.alpha, "beta": call.beta, "activation": call.activation, **M5}
    previous = os.environ.get("TORCH_STEEL_SIM_LAYOUT_SEED")
    os.environ["TORCH_STEEL_SIM_LAYOUT_SEED"] = str(call.seed % 100_000)
    try:
        p = sim.plan("gemm", tensors, options)
        assert p.ok, p.reason
        # M <= 8 or N <= 8 goes to the GEMV kernels on every device (9bd6890), which
        # test_fuzz_gemm fuzzes: not a matmul2d call
        assume(not p.dispatches[0].kernel.startswith("steel_gemv_"))
        assert p.dispatches[0].kernel.startswith("steel_gemm_tensor_"), p.dispatches[0].kernel
        (out,) = sim.run_op("gemm", tensors, options, checkers=True)
    finally:
        if previous is None:
            del os.environ["TORCH_STEEL_SIM_LAYOUT_SEED"]
        else:
            os.environ["TORCH_STEEL_SIM_LAYOUT_SEED"] = previous
    check_result(call, t, guards, out)


@fixed(40)
@given(gemm_calls(dtypes=HALF))
def test_gemm_tensor_matches_float64(call):
    """Fixed-seed subset: 40 drawn calls on the matmul2d kernels, each under its own cooperative
    tensor layouts, agree with float64 math and leave their guard bytes untouched."""
    check_gemm_tensor(call)


@fuzz_mark
@fuzz(lambda call: ["matmul2d gemm"])
@given(gemm_calls(dtypes=HALF))
def test_fuzz_gemm_tensor(call):
    """-m fuzz: random calls on the matmul2d kernels agree with float64 math."""
    check_gemm_tensor(call)
