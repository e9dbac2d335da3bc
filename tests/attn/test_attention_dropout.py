"""In-kernel dropout (shaders/steel/attn/dropout.h) in the forward and both backward kernels, in
the simulator with checkers on: the kernel's keep mask is bit-identical to
torch_steel.dropout.keep_mask (element for element), and outputs and gradients equal the float64
reference, which regenerates the same mask from the same seed and offset."""

from __future__ import annotations

import pytest
import torch
from attn_helpers import check, qkv, requires_simulator, steel
from test_attention_backward import check as check_grads

from torch_steel import dropout

pytestmark = requires_simulator


@pytest.mark.parametrize("L,S,H", [(33, 40, 2), (7, 9, 3), (70, 24, 1)])
def test_kernel_mask_is_the_reference_mask(L, S, H):
    """With v the identity (Ev = S), out[row, key] is the dropped weight: zero exactly where the
    kernel dropped (key, row), so the kernel's mask can be read off and compared bit for bit."""
    q, k, _ = qkv(2, H, L, S, 32, dtype=torch.float32)
    v = torch.eye(S).expand(2, H, S, S)
    seed, offset = 0x1234_5678_9ABC, 7
    out, _ = steel(q, k, v, dropout_p=0.3, seed=seed, offset=offset)
    want = dropout.keep_mask(seed, offset, torch.arange(2 * H), L, S, 0.3).reshape(2, H, L, S)
    assert torch.equal(out != 0, want)
    assert 0.6 < float(want.float().mean()) < 0.8


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_forward_matches_the_reference(dtype):
    q, k, v = qkv(2, 4, 33, 47, 64, Hkv=2, dtype=dtype)
    check(q, k, v, dropout_p=0.2, seed=99, enable_gqa=True, is_causal=True)
    check(q, k, v, torch.rand(33, 47) > 0.3, dropout_p=0.5, seed=3, offset=11, enable_gqa=True)


@pytest.mark.parametrize("options", [{}, {"is_causal": True, "causal_align": "bottom_right"},
                                     {"window": (10, 2), "softcap": 8.0}])  # fmt: skip
def test_gradients_match_the_reference(options):
    q, k, v = qkv(1, 4, 40, 33, 64, Hkv=2, dtype=torch.float32)
    check_grads(q, k, v, dropout_p=0.25, seed=5, offset=2, enable_gqa=True, **options)
