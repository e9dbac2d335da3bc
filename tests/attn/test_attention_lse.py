"""The lse store under STEEL_ATTN_FC_LSE: the forward kernels (prefill, decode one pass and split,
the split's merge, the matmul2d prefill) store lse only when the run option "lse" is not 0, and
torch_steel.sdpa passes lse = 0 when nothing will read it (no return_lse, no gradient recorded).

Oracles: out is compared bit for bit with the same plan storing lse (only a store is removed,
so nothing else may change) and with float64 reference math (attn_helpers' tolerances); the
lse binding's written bytes come from the simulator's counters, and must be exactly 0 without
lse and exactly one float32 per (batch, head, row) with it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attn_helpers import assert_attention_close, oracle, qkv, requires_simulator, scale_of
from gemm_helpers import M5

import torch_steel
from torch_steel import ops, sim

pytestmark = requires_simulator

BUF_LSE = 6  # STEEL_ATTN_BUF_LSE (shaders/steel/params.h)


def run(q, k, v, lse, **extra):
    opts = {"scale": scale_of(q.shape[-1]), "is_causal": False, **extra}
    if not lse:
        opts["lse"] = 0
    outputs, counters = sim.run_op("sdpa", [q, k, v, None, None], opts, counters=True)
    return outputs, counters


# The shapes, scaled where the simulator would take minutes: prefill f16 d64 B2 H4/2
# L=S=100 (ragged: 100 % 32 = 4); GQA decode H32/8 d128 (S cut to 300 keys); MHA decode H8 d64
# S=97 (97 % 32 = 1), one pass and split.
CASES = {
    "prefill": (dict(B=2, H=4, Hkv=2, L=100, S=100, E=64), {}),
    "prefill_causal": (dict(B=1, H=2, Hkv=1, L=63, S=95, E=64), {"is_causal": True}),
    "decode_gqa": (dict(B=1, H=32, Hkv=8, L=1, S=300, E=128), {"num_splits": 1}),
    "decode_gqa_split": (dict(B=1, H=32, Hkv=8, L=1, S=300, E=128), {"num_splits": 3}),
    "decode_mha_split": (dict(B=2, H=8, Hkv=8, L=1, S=97, E=64), {"num_splits": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_without_lse_out_is_unchanged_and_lse_is_not_written(case):
    shape, extra = CASES[case]
    q, k, v = qkv(shape["B"], shape["H"], shape["L"], shape["S"], shape["E"],
                  Hkv=shape["Hkv"])  # fmt: skip
    (out_on, lse_on), with_lse = run(q, k, v, True, **extra)
    (out_off, _), without = run(q, k, v, False, **extra)
    kernels = [c["kernel"] for c in with_lse]
    assert kernels == [c["kernel"] for c in without]
    if case.startswith("decode"):
        assert kernels[0].startswith("steel_attention_decode_")
        assert (len(kernels) == 2) == case.endswith("split"), kernels
    assert torch.equal(out_on, out_off)
    ref_out, ref_lse = oracle(q, k, v, enable_gqa=True, is_causal=extra.get("is_causal", False))
    assert_attention_close(out_on, lse_on, ref_out, ref_lse, q.dtype, float(v.abs().max()))
    rows = shape["B"] * shape["H"] * shape["L"]
    assert with_lse[-1]["buffers"][BUF_LSE]["written"] == 4 * rows
    for c in without:
        assert c["buffers"].get(BUF_LSE, {"written": 0})["written"] == 0, c["kernel"]
    if len(kernels) == 2:  # the split's partial maxima and sums are still stored for the merge
        part_ml = max(without[0]["buffers"])
        assert (
            without[0]["buffers"][part_ml]["written"]
            == (with_lse[0]["buffers"][part_ml]["written"])
            == 8 * rows * extra["num_splits"]
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matmul2d_prefill_without_lse(dtype):
    q, k, v = qkv(1, 2, 100, 100, 64, dtype=dtype)
    with sim.device({**M5, "decode": 0}):
        (out_on, lse_on), with_lse = run(q, k, v, True)
        (out_off, _), without = run(q, k, v, False)
    assert with_lse[0]["kernel"].startswith("steel_attention_tensor_")
    assert torch.equal(out_on, out_off)
    assert with_lse[0]["buffers"][BUF_LSE]["written"] == 4 * 2 * 100
    assert without[0]["buffers"].get(BUF_LSE, {"written": 0})["written"] == 0


def spied(monkeypatch):
    """The run options of every sdpa call torch_steel makes (through backends.run)."""
    seen = []
    real = ops.attention_ops.run

    def spy(op, tensors, options, reference):
        seen.append(dict(options))
        return real(op, tensors, options, reference)

    monkeypatch.setattr(ops.attention_ops, "run", spy)
    return seen


@pytest.mark.parametrize(
    "grad,no_grad_mode,return_lse,stored",
    [
        (False, False, False, False),  # inference: nothing reads lse
        (False, False, True, True),  # return_lse
        (True, False, False, True),  # a gradient will be taken: the backward reads lse
        (True, True, False, False),  # requires_grad under no_grad: nothing is recorded
    ],
)
def test_sdpa_asks_for_lse_only_when_it_is_read(monkeypatch, grad, no_grad_mode, return_lse,
                                                stored):  # fmt: skip
    q, k, v = (t.requires_grad_(grad) for t in qkv(1, 2, 37, 33, 64, dtype=torch.float32))
    seen = spied(monkeypatch)
    with torch_steel.backend("sim"), torch.set_grad_enabled(not no_grad_mode):
        got = torch_steel.sdpa(q, k, v, is_causal=True, return_lse=return_lse)
        out = got[0] if return_lse else got
        if grad and not no_grad_mode:
            out.sum().backward()
    assert seen[0].get("lse", 1) == (1 if stored else 0)
    # float32 inputs: the kernel's fp32 math against PyTorch's, a few ulps of the sums.
    want = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True)
    torch.testing.assert_close(out.detach(), want, atol=1e-5, rtol=1e-5)
    if return_lse:
        ref = torch.logsumexp(
            (q.detach() @ k.detach().transpose(-1, -2) * scale_of(64)).masked_fill(
                torch.ones(37, 33, dtype=torch.bool).triu(1), float("-inf")
            ),
            -1,
        )
        torch.testing.assert_close(got[1], ref, atol=1e-5, rtol=1e-5)
    if grad and not no_grad_mode:
        qd = q.detach().requires_grad_()
        F.scaled_dot_product_attention(qd, k.detach(), v.detach(), is_causal=True).sum().backward()
        torch.testing.assert_close(q.grad, qd.grad, atol=1e-4, rtol=1e-4)
