"""Shared pieces of the attention kernel tests: running the kernel, the float64 oracle, the
per-dtype tolerances."""

from __future__ import annotations

import contextlib
import math
import os
import sys
from pathlib import Path

import torch

import torch_steel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gemm"))
from gemm_helpers import rand, requires_planner, requires_simulator  # noqa: E402, F401

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
FC_DECODE_DIRECT = 342  # params.h STEEL_ATTN_FC_DECODE_DIRECT

# Half an ulp at 1.0 of each dtype: out is computed in fp32 and rounded once to its dtype.
OUT_ROUNDING = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


@contextlib.contextmanager
def strict(on=True):
    """TORCH_STEEL_STRICT for the block: a refused plan raises instead of falling back."""
    previous = os.environ.get("TORCH_STEEL_STRICT")
    os.environ["TORCH_STEEL_STRICT"] = "1" if on else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TORCH_STEEL_STRICT"]
        else:
            os.environ["TORCH_STEEL_STRICT"] = previous


def steel(q, k, v, attn_mask=None, **kwargs):
    """(out, lse) of torch_steel.sdpa served by the attention kernel in the simulator, checkers
    on; strict, so a plan refusal fails the test instead of falling back to reference math."""
    with strict(), torch_steel.backend("sim"):
        return torch_steel.sdpa(q, k, v, attn_mask, return_lse=True, **kwargs)


def oracle(q, k, v, attn_mask=None, **kwargs):
    """The same call in float64 reference math (torch_steel.reference), the tests' oracle."""
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.double()
    sinks = kwargs.get("sinks")
    if sinks is not None:
        kwargs["sinks"] = sinks.double()
    with torch_steel.backend("reference"):
        return torch_steel.sdpa(q.double(), k.double(), v.double(), attn_mask, return_lse=True,
                                **kwargs)  # fmt: skip


def score_error(q, k, scale=None):
    """A bound on the fp32 error of the scores: rounding errors of a dot product of E terms add
    like a random walk, about sqrt(E) ulps of fp32 relative to scale * sum |q_d k_d|; four
    times that, so that the bound is never flaky."""
    E = q.shape[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else abs(scale)
    k = k.double().abs().repeat_interleave(q.shape[-3] // k.shape[-3], -3)
    mag = (q.double().abs() @ k.transpose(-1, -2)).amax() if q.numel() and k.numel() else 0.0
    return 4.0 * math.sqrt(E) * 2.0**-24 * scale * float(mag)


def assert_attention_close(out, lse, ref_out, ref_lse, dtype, v_max=4.0, score_err=0.0,
                           weight_rounding=0.0):  # fmt: skip
    """out within the rounding of its dtype plus the fp32 error; lse within the fp32 error.

    - out is accumulated in fp32 and rounded once to its dtype: half an ulp relative to |ref|;
    - an error e in the scores moves a softmax-weighted mean of values by at most
      2 * e * max|v| (score_err, see score_error); exp, the sums over keys and P V add a few
      fp32 ulps of max|v|: 1e-5 absolute covers them;
    - weight_rounding: a kernel that rounds the unnormalised weights exp(s - m) to a storage
      dtype before P V (relative error at most that dtype's unit roundoff u, while the row sum
      keeps them in fp32) moves the weighted mean by at most u * max|v|;
    - lse is computed in fp32 from the same scores: score_err plus 2e-6 relative plus 1e-5.
    """
    assert out.dtype == dtype, (out.dtype, dtype)
    assert out.shape == ref_out.shape, (out.shape, ref_out.shape)
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    err = (out.double() - ref_out).abs()
    bound = (OUT_ROUNDING[dtype] * ref_out.abs() + 2 * score_err * v_max + 1e-5
             + weight_rounding * v_max)  # fmt: skip
    same_nan = out.isnan() == ref_out.isnan()
    assert bool(same_nan.all()), "NaN where the reference has none, or the other way round"
    bad = (err > bound) & ~ref_out.isnan()
    assert not bool(bad.any()), (
        f"out: {int(bad.sum())} of {bad.numel()} elements off; worst error "
        f"{float(err.nan_to_num(0).max()):.3g}"
    )
    assert bool((lse.isneginf() == ref_lse.isneginf()).all()), "lse: rows that see nothing differ"
    assert bool((lse.isnan() == ref_lse.isnan()).all()), "lse: NaN rows differ"
    finite = torch.isfinite(ref_lse)
    lerr = (lse.double() - ref_lse)[finite].abs()
    lbound = 2e-6 * ref_lse[finite].abs() + score_err + 1e-5
    assert not bool((lerr > lbound).any()), f"lse off by {float(lerr.max()):.3g}"


def check(q, k, v, attn_mask=None, weight_rounding=0.0, **kwargs):
    """Runs the kernel and compares it with the float64 oracle; returns (out, lse)."""
    out, lse = steel(q, k, v, attn_mask, **kwargs)
    ref_out, ref_lse = oracle(q, k, v, attn_mask, **kwargs)
    v_max = float(v.double().abs().max()) if v.numel() else 0.0
    err = score_error(q, k, kwargs.get("scale"))
    assert_attention_close(out, lse, ref_out, ref_lse, q.dtype, v_max, err, weight_rounding)
    return out, lse


def qkv(B, H, L, S, E, Ev=None, *, Hkv=None, dtype=torch.float16, gen=None, batch=None):
    """Random q [*batch, H, L, E], k [*batch, Hkv, S, E], v [*batch, Hkv, S, Ev], values exact in
    dtype."""
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    batch = (B,) if batch is None else tuple(batch)
    Ev = E if Ev is None else Ev
    Hkv = H if Hkv is None else Hkv
    q = rand(*batch, H, L, E, dtype=dtype, gen=gen)
    k = rand(*batch, Hkv, S, E, dtype=dtype, gen=gen)
    v = rand(*batch, Hkv, S, Ev, dtype=dtype, gen=gen)
    return q, k, v


def scale_of(E):
    return 1.0 / math.sqrt(E)
