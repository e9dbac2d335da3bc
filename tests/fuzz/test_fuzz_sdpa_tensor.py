"""Property-based differential tests of the attention prefill on Metal 4's matmul2d
(shaders/steel/attn_tensor, planned by mps_src/plan/attention_plan.cpp for an M5-generation
device only) in the Metal simulator emulating such a device, checkers on.

The calls are strategies.sdpa_calls() in float16 and bfloat16 (the kernel's dtypes), the device
described as Metal 4 + Apple10 with the tensor-op library, and the cooperative tensors'
element-to-thread layouts drawn per call (TORCH_STEEL_SIM_LAYOUT_SEED from the call's seed), so
that a kernel relying on one layout fails some draw. Only calls the kernel serves are kept (head
dims that pad to 64 / 96 / 128 / 256, more than 8 query rows; the plan decides). The bound is
test_fuzz_sdpa.check_sdpa's plus the weights' rounding to the inputs' dtype before P V (the
kernel's probability tile), at most that dtype's unit roundoff times max|v|.
"""

from __future__ import annotations

import os

import torch
from fuzz_helpers import fixed, fuzz, fuzz_mark, requires_simulator
from gemm_helpers import M5
from hypothesis import given
from strategies import sdpa_calls
from test_fuzz_sdpa import check_sdpa

import torch_steel
from torch_steel import sim

pytestmark = requires_simulator

HALF = (torch.float16, torch.bfloat16)
WEIGHT_ROUNDING = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def kernels(call):
    """The kernels the M5 plan of `call` dispatches."""
    t, _ = call.build()
    q, k, v = torch_steel.ops.attention_ops._broadcast_qkv(
        t["q"], t["k"], t["v"], call.Hq != call.Hkv
    )
    p = sim.plan("sdpa", [q, k, v, t["attn_mask"], t["sinks"]], {"scale": 0.1, **M5})
    return [d.kernel for d in p.dispatches] if p.ok else []


def served(call):
    """The matmul2d kernel serves the call (a head-dim pair padding to 64, 96, 128 or 256, more
    than 8 query rows): the others would test the simdgroup kernels again."""
    ks = kernels(call)
    return bool(ks) and all(k.startswith("steel_attention_tensor_") for k in ks)


def tensor_calls():
    return sdpa_calls(dtypes=HALF).filter(served)


def check_sdpa_tensor(call):
    previous = os.environ.get("TORCH_STEEL_SIM_LAYOUT_SEED")
    os.environ["TORCH_STEEL_SIM_LAYOUT_SEED"] = str(call.seed % 100_000)
    try:
        with sim.device(M5):
            check_sdpa(call, WEIGHT_ROUNDING[call.dtype])
    finally:
        if previous is None:
            del os.environ["TORCH_STEEL_SIM_LAYOUT_SEED"]
        else:
            os.environ["TORCH_STEEL_SIM_LAYOUT_SEED"] = previous


@fixed(40)
@given(tensor_calls())
def test_sdpa_tensor_matches_float64(call):
    """Fixed-seed subset: 40 drawn calls on the matmul2d kernel, each under its own cooperative
    tensor layouts, agree with float64 math and leave their guard bytes untouched."""
    check_sdpa_tensor(call)


@fuzz_mark
@fuzz(lambda call: ["matmul2d attention"])
@given(tensor_calls())
def test_fuzz_sdpa_tensor(call):
    """-m fuzz: random calls on the matmul2d kernel agree with float64 math."""
    check_sdpa_tensor(call)
