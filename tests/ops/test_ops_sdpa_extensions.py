"""The keyword-only extensions of steel::sdpa against straightforward float64 formulas."""

import pytest
import torch
from ops_helpers import naive_attention, randn, torch_sdpa64
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import torch_steel
from torch_steel import dropout

TOL64 = {"atol": 1e-10, "rtol": 1e-10}


def _band(L, S, left, right, bottom_right):
    """keep[i, j] for a window (left, right) around the aligned diagonal, -1 = unbounded."""
    i = torch.arange(L).unsqueeze(1) + (S - L if bottom_right else 0)
    j = torch.arange(S).unsqueeze(0)
    keep = torch.ones(L, S, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


# PyTorch warns that its own lower-right bias gives NaN rows when L > S; steel gives zeros.
@pytest.mark.filterwarnings("ignore:Lower right causal bias")
@pytest.mark.parametrize("L,S", [(4, 9), (9, 4), (6, 6)])
def test_causal_bottom_right(L, S):
    q, k, v = randn(2, 3, L, 8), randn(2, 3, S, 8), randn(2, 3, S, 8)
    keep = _band(L, S, -1, 0, True)
    expected, _ = naive_attention(q, k, v, keep=keep)
    out = torch_steel.sdpa(q, k, v, is_causal=True, causal_align="bottom_right")
    torch.testing.assert_close(out, expected, **TOL64)
    # PyTorch's own bias object means the same thing and is accepted as attn_mask.
    torch.testing.assert_close(torch_steel.sdpa(q, k, v, causal_lower_right(L, S)), out, **TOL64)
    torch.testing.assert_close(
        torch_steel.sdpa(q, k, v, causal_upper_left(L, S)),
        torch_sdpa64(q, k, v, is_causal=True),
        **TOL64,
    )


@pytest.mark.parametrize("window", [(2, 0), (1, 3), (-1, 1), (0, -1)])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_sliding_window(window, align):
    q, k, v = randn(1, 2, 7, 8), randn(1, 2, 10, 8), randn(1, 2, 10, 8)
    keep = _band(7, 10, *window, align == "bottom_right")
    expected, expected_lse = naive_attention(q, k, v, keep=keep)
    out, lse = torch_steel.sdpa(q, k, v, window=window, causal_align=align, return_lse=True)
    torch.testing.assert_close(out, expected, **TOL64)
    torch.testing.assert_close(lse, expected_lse, **TOL64)


def test_window_with_causal_is_the_intersection():
    q, k, v = randn(1, 1, 8, 4), randn(1, 1, 8, 4), randn(1, 1, 8, 4)
    keep = _band(8, 8, 3, 0, False)
    out = torch_steel.sdpa(q, k, v, is_causal=True, window=(3, 5))
    torch.testing.assert_close(out, naive_attention(q, k, v, keep=keep)[0], **TOL64)


def test_sinks():
    q, k, v = randn(2, 4, 5, 8), randn(2, 2, 6, 8), randn(2, 2, 6, 3)
    sinks = randn(4)
    mask = torch.rand(5, 6) > 0.4
    mask[0] = False  # a row with only the sink: output 0, lse = sink
    expected, expected_lse = naive_attention(q, k, v, keep=mask, sinks=sinks)
    out, lse = torch_steel.sdpa(q, k, v, mask, enable_gqa=True, sinks=sinks, return_lse=True)
    torch.testing.assert_close(out, expected, **TOL64)
    torch.testing.assert_close(lse, expected_lse, **TOL64)
    torch.testing.assert_close(lse[:, :, 0], sinks.expand(2, 4), **TOL64)


def test_sinks_gradient_matches_autograd_of_the_formula():
    q, k, v = (randn(1, 2, 4, 4, requires_grad=True) for _ in range(3))
    sinks = randn(2, requires_grad=True)
    out = torch_steel.sdpa(q, k, v, sinks=sinks, is_causal=True)
    expected, _ = naive_attention(q, k, v, keep=_band(4, 4, -1, 0, False), sinks=sinks)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v, sinks), grad)
    theirs = torch.autograd.grad(expected, (q, k, v, sinks), grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **TOL64)


def test_softcap_before_additive_mask():
    q, k, v = randn(1, 2, 5, 8) * 3, randn(1, 2, 7, 8) * 3, randn(1, 2, 7, 8)
    bias = randn(5, 7)
    expected, expected_lse = naive_attention(q, k, v, bias=bias, softcap=5.0, scale=0.5)
    out, lse = torch_steel.sdpa(q, k, v, bias, scale=0.5, softcap=5.0, return_lse=True)
    torch.testing.assert_close(out, expected, **TOL64)
    torch.testing.assert_close(lse, expected_lse, **TOL64)


def test_lse_is_differentiable():
    q, k, v = (randn(1, 2, 3, 4, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        out, lse = torch_steel.sdpa(q, k, v, softcap=2.0, return_lse=True)
        return out.sum() + (lse * torch.arange(3.0, dtype=lse.dtype)).sum()

    assert torch.autograd.gradcheck(fn, (q, k, v))


# ---------------------------------------------------------------------------- dropout


@pytest.mark.parametrize(
    "counter,key,expected",
    [  # Known-answer vectors of Philox4x32-10 from Random123 (kat_vectors).
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_known_answers(counter, key, expected):
    words = dropout.philox4x32(*(torch.tensor(c, dtype=torch.int64) for c in counter), *key)
    assert tuple(int(w) for w in words) == expected


def test_dropout_mask_layout():
    """keep(b, h, i, j) is word j % 4 of philox((j // 4, i, b * H + h, offset), seed)."""
    seed, offset, p = 0x1234_5678_9ABC, 5, 0.25
    keep = dropout.keep_mask(seed, offset, torch.arange(6), 3, 10, p)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    bh, i, j = 4, 2, 9
    words = dropout.philox4x32(t(j // 4), t(i), t(bh), t(offset), seed & 0xFFFFFFFF, seed >> 32)
    assert bool(keep[bh, i, j]) == (int(words[j % 4]) >= int(p * 2**32))


def test_dropout_applies_the_regenerated_mask():
    q, k, v = randn(2, 3, 6, 4), randn(2, 3, 9, 4), randn(2, 3, 9, 5)
    p, seed = 0.4, 99
    keep = dropout.keep_mask(seed, 0, torch.arange(6), 6, 9, p).reshape(2, 3, 6, 9)
    weights = torch.softmax(q @ k.mT / 2.0, -1)
    expected = (weights * keep / (1 - p)) @ v
    out = torch_steel.sdpa(q, k, v, dropout_p=p, seed=seed)
    torch.testing.assert_close(out, expected, **TOL64)


def test_dropout_statistics_and_repeatability():
    keep = dropout.keep_mask(7, 0, torch.arange(8), 64, 64, 0.3)
    # 32768 Bernoulli(0.7) draws: the standard deviation of the mean is 0.0025.
    assert abs(keep.double().mean().item() - 0.7) < 0.0125
    q, k, v = randn(1, 2, 8, 4), randn(1, 2, 8, 4), randn(1, 2, 8, 4)
    torch.manual_seed(3)
    a = torch_steel.sdpa(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    b = torch_steel.sdpa(q, k, v, dropout_p=0.5)
    c = torch_steel.sdpa(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (torch_steel.sdpa(q, k, v, dropout_p=1.0) == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(200))
def test_random_configurations(trial):
    """Random mixes of every option against the row-by-row formula (run with -m slow)."""
    g = torch.Generator().manual_seed(trial)

    def pick(n):
        return int(torch.randint(n, (), generator=g))

    L, S, hkv, groups = 1 + pick(9), 1 + pick(9), 1 + pick(2), 1 + pick(3)
    q = torch.randn(2, hkv * groups, L, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, hkv, S, 4, generator=g, dtype=torch.float64)
    v = torch.randn(2, hkv, S, 1 + pick(5), generator=g, dtype=torch.float64)
    window = (pick(4) - 1, pick(4) - 1)
    bottom_right = bool(pick(2))
    is_causal = bool(pick(2))
    mask = torch.rand(L, S, generator=g) > 0.3 if pick(2) else None
    sinks = torch.randn(hkv * groups, generator=g, dtype=torch.float64) if pick(2) else None
    softcap = [0.0, 2.0][pick(2)]
    keep = _band(L, S, window[0], 0 if is_causal else window[1], bottom_right)
    if is_causal and window[1] >= 0:
        keep &= _band(L, S, -1, window[1], bottom_right)
    if mask is not None:
        keep &= mask
    expected, expected_lse = naive_attention(q, k, v, keep=keep, sinks=sinks, softcap=softcap)
    out, lse = torch_steel.sdpa(
        q, k, v, mask, is_causal=is_causal, enable_gqa=True, sinks=sinks, softcap=softcap,
        window=window, causal_align="bottom_right" if bottom_right else "top_left",
        return_lse=True,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, **TOL64)
    torch.testing.assert_close(lse, expected_lse, **TOL64)
