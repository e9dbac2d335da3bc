"""Property-based differential tests of the attention backward on Metal 4's matmul2d
(shaders/steel/attn_tensor/backward_tensor.h, planned for an M5-generation device only) in the
Metal simulator emulating such a device, checkers on.

The calls are strategies.sdpa_calls() in float16 and bfloat16 with a dropout and mask-gradient
draw, the device described as Metal 4 + Apple10 with the tensor-op library (decode off, so that
short calls' forwards run on matmul2d too), and the cooperative tensors' layouts drawn per call
(TORCH_STEEL_SIM_LAYOUT_SEED from the call's seed). Only calls whose backward plan runs the
matmul2d dK/dV or dQ kernels are kept. The bound is test_fuzz_sdpa_backward's plus the
rounding of P o Z and dS to the inputs' dtype before the products (2u of the largest gradient
element, as tests/attn/test_attention_backward_tensor.py argues).
"""

from __future__ import annotations

import os

import torch
from fuzz_helpers import fixed, fuzz, fuzz_mark, requires_simulator
from gemm_helpers import M5
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import MAX_BACKWARD_HEAD_DIM, sdpa_calls
from test_fuzz_sdpa_backward import compare_backward

import torch_steel
from torch_steel import sim

pytestmark = requires_simulator

HALF = (torch.float16, torch.bfloat16)
UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
DEVICE = {**M5, "decode": 0}


def served(call, dropout):
    """The M5 backward plan of the call runs the matmul2d kernels (a head-dim pair padding to
    64, 96, 128 or 256: the plan decides; the others would test the simdgroup kernels again)."""
    t, _ = call.build()
    qe, ke, ve = torch_steel.ops.attention_ops._broadcast_qkv(
        t["q"], t["k"], t["v"], call.Hq != call.Hkv
    )
    probe = torch.empty(*qe.shape[:-1], ve.shape[-1], dtype=call.dtype)
    lse = torch.empty(qe.shape[:-1])
    p = sim.plan("sdpa_backward", [probe, qe, ke, ve, probe, lse, t["attn_mask"], t["sinks"], lse],
                 {"scale": 0.1, "dropout_p": dropout, **DEVICE})  # fmt: skip
    return p.ok and any(d.kernel.startswith("steel_attention_bwd_tensor_") for d in p.dispatches)


def check_backward_tensor(call, dropout, mask_grad):
    assume(served(call, dropout))
    previous = os.environ.get("TORCH_STEEL_SIM_LAYOUT_SEED")
    os.environ["TORCH_STEEL_SIM_LAYOUT_SEED"] = str(call.seed % 100_000)
    try:
        with sim.device(DEVICE):
            compare_backward(call, dropout, mask_grad, 2 * UNIT[call.dtype])
    finally:
        if previous is None:
            del os.environ["TORCH_STEEL_SIM_LAYOUT_SEED"]
        else:
            os.environ["TORCH_STEEL_SIM_LAYOUT_SEED"] = previous


CALLS = (
    sdpa_calls(dtypes=HALF, max_head_dim=MAX_BACKWARD_HEAD_DIM),
    st.sampled_from([0.0, 0.0, 0.3]),
    st.booleans(),
)


@fixed(10)
@given(*CALLS)
def test_sdpa_backward_tensor_matches_float64(call, dropout, mask_grad):
    """Fixed-seed subset: 10 drawn calls' gradients on the matmul2d backward, each under its own
    cooperative tensor layouts, agree with float64 autograd."""
    check_backward_tensor(call, dropout, mask_grad)


@fuzz_mark
@fuzz(lambda call, dropout, mask_grad: ["matmul2d attention backward"])
@given(*CALLS)
def test_fuzz_sdpa_backward_tensor(call, dropout, mask_grad):
    """-m fuzz: random calls' gradients on the matmul2d backward agree with float64 autograd."""
    check_backward_tensor(call, dropout, mask_grad)
