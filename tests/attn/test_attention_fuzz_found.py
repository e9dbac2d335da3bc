"""Cases the property-based tests (tests/fuzz/test_fuzz_sdpa.py) found, kept as ordinary
regression tests: the attention forward kernel in the simulator, checkers on, against float64
reference math."""

from __future__ import annotations

import pytest
import torch
from attn_helpers import DTYPES, OUT_ROUNDING, oracle, qkv, requires_simulator, steel

pytestmark = requires_simulator


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_window_leaves_only_finfo_min_padded_keys(dtype):
    """A sliding window (1, -1) aligned bottom-right leaves the single query row (L = 1, S = 7)
    only the last two keys, and both are padded with finfo(dtype).min (Hugging Face's padding):
    the row sees nothing but padding (E = 192, Ev = 128, the MLA-style kernel).

    The fuzz run found it as a false alarm of its own bound, which had taken the row's scale
    from keys that the window hides; kept because it is the one combination of window, padding
    and head dims that no hand-written test had. float16: finfo.min is -65504, whose fp32 ulp
    is 2^-8, so the kernel's scores are rounded to 2^-8 by the addition and each weight moves by
    at most 2^-8 relative: the bound is 2^-8 * max|v| more than the ordinary one. bfloat16 and
    float32: finfo.min swamps the scores (in fp32 and in float64 alike), so the row is exactly
    the mean of the two visible values.
    """
    q, k, v = qkv(1, 1, 1, 7, 192, 128, dtype=dtype)
    mask = torch.zeros(1, 7, dtype=dtype)
    mask[:, 3:] = torch.finfo(dtype).min
    kwargs = {"window": (1, -1), "causal_align": "bottom_right"}
    out, lse = steel(q, k, v, mask, **kwargs)
    ref_out, ref_lse = oracle(q, k, v, mask, **kwargs)
    assert not bool(out.isnan().any()) and bool(torch.isfinite(lse).all())
    if dtype == torch.float16:
        expected = ref_out
        slack = 2.0**-8 * float(v.double().abs().max())
    else:
        expected = v.double()[..., 5:, :].mean(-2, keepdim=True)
        slack = 0.0
    bound = OUT_ROUNDING[dtype] * expected.abs() + slack + 1e-5
    assert bool(((out.double() - expected).abs() <= bound).all())
