"""Shared pieces of the GEMM tests: the float64 oracle, tolerances, the simulator skip."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torch_steel import sim

DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# Relative rounding of one result stored in each dtype (half an ulp at 1.0).
_OUT_ROUNDING = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def simulator_ready() -> tuple[bool, str]:
    """The simulator (issue 3) builds and loads the shaders; tests that run kernels need it."""
    try:
        ok = sim.available()
    except Exception as e:  # noqa: BLE001 (any build failure means "not ready", with the reason)
        return False, f"Metal simulator not available: {e}"
    return ok, "Metal simulator not available (clang-19 missing or the build fails)"


def planner_ready() -> tuple[bool, str]:
    """torch_steel.sim.plan works (the simulator module and the planners build)."""
    try:
        sim.plan("gemm", [torch.zeros(1, 1), torch.zeros(1, 1), None, None], {})
    except Exception as e:  # noqa: BLE001
        return False, f"torch_steel.sim.plan not available: {e}"
    return True, ""


# Device descriptions (mps_src/plan/device.h) for the plans' device gating: an M5-generation
# GPU with Metal 4 and the tensor-op library gets the matmul2d kernels; these do not.
M5 = {"device_apple_family": 10, "device_metal4": True, "device_tensor_ops": True}
NOT_M5 = {
    "no description (the simulator's default)": {},
    "M4: Apple9 with Metal 4": {
        "device_apple_family": 9,
        "device_metal4": True,
        "device_tensor_ops": True,
    },
    "M5 on an OS without Metal 4": {
        "device_apple_family": 10,
        "device_metal4": False,
        "device_tensor_ops": True,
    },
    "M5, library built with an old SDK": {
        "device_apple_family": 10,
        "device_metal4": True,
        "device_tensor_ops": False,
    },
}

requires_simulator = pytest.mark.skipif(not simulator_ready()[0], reason=simulator_ready()[1])
requires_planner = pytest.mark.skipif(not planner_ready()[0], reason=planner_ready()[1])


def rand(*shape, dtype, gen, scale=1.0):
    """Values exactly representable in `dtype` (so float64 sees the kernel's exact inputs)."""
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


# The C operand's shapes by kind for an m x n output: none, full, a row (broadcast down the
# rows), a column, a scalar; each broadcasts against the output as torch's addmm does.
C_KINDS = [None, "full", "row", "col", "scalar"]


def epilogue_operands(m, n, c_kind, use_bias, dtype, gen):
    """(bias or None, c or None) of an epilogue test, drawn from `gen` in that order."""
    bias = rand(n, dtype=dtype, gen=gen) if use_bias else None
    c = {None: None, "full": (m, n), "row": (n,), "col": (m, 1), "scalar": ()}[c_kind]
    return bias, None if c is None else rand(*c, dtype=dtype, gen=gen)


def reference(a, b, bias=None, c=None, alpha=1.0, beta=1.0, activation="none"):
    """act(alpha * a @ b + beta * c + bias) in float64; also returns alpha * |a| @ |b|, the scale
    of the fp32 accumulation error."""
    a64, b64 = a.double(), b.double()
    out = alpha * torch.matmul(a64, b64)
    mag = abs(alpha) * torch.matmul(a64.abs(), b64.abs())
    if c is not None and beta != 0:
        out = out + beta * c.double()
        mag = mag + abs(beta) * c.double().abs()
    if bias is not None:
        out = out + bias.double()
        mag = mag + bias.double().abs()
    if activation == "relu":
        out = torch.relu(out)
    elif activation == "gelu":
        out = F.gelu(out)
    elif activation == "gelu_tanh":
        out = F.gelu(out, approximate="tanh")
    elif activation == "silu":
        out = F.silu(out)
    return out, mag


def assert_close(out, ref, mag, k, dtype):
    """|out - ref| <= rounding of the stored result + fp32 accumulation error + epilogue error.

    - storing: half an ulp of the dtype, relative to |ref|;
    - accumulating K products in fp32 (each product of two f16/bf16/f32 inputs, summed in
      binary32): at most about K ulps of fp32 relative to sum |a||b| (the classic K * eps bound,
      loose in practice but never flaky);
    - the epilogue in fp32 (alpha, beta*c, bias, and erf/tanh/exp approximations good to a few
      1e-7): a few fp32 ulps of the magnitude plus 2e-6 absolute;
    - the activations' slopes are at most 1.13 (gelu, silu), so errors before them grow by at
      most 1.25.
    """
    assert out.dtype == dtype
    assert out.shape == ref.shape, (out.shape, ref.shape)
    err = (out.double() - ref).abs()
    eps32 = 2.0**-24
    bound = _OUT_ROUNDING[dtype] * ref.abs() + 1.25 * (k + 24) * eps32 * mag + 2e-6
    bad = err > bound
    assert not bool(bad.any()), (
        f"{int(bad.sum())} of {bad.numel()} elements off; worst error "
        f"{float(err.max()):.3g} vs bound {float(bound.flatten()[err.flatten().argmax()]):.3g}"
    )
    assert not math.isnan(float(out.double().sum()))
