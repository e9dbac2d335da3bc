"""steel::sdpa_varlen against a loop of dense calls, one per sequence."""

import pytest
import torch
from ops_helpers import randn

import torch_steel

TOL64 = {"atol": 1e-10, "rtol": 1e-10}


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _dense_loop(q, k, v, lq, lk, **kwargs):
    """Each sequence as its own dense [1, heads, n, dim] torch_steel.sdpa call."""
    outs, lses = [], []
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for b in range(len(lq)):
        qs = q[cq[b] : cq[b + 1]].transpose(0, 1).unsqueeze(0)
        ks = k[ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        vs = v[ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        out, lse = torch_steel.sdpa(qs, ks, vs, enable_gqa=True, return_lse=True, **kwargs)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, 1)


CONFIGS = [
    {},
    {"is_causal": True},
    {"is_causal": True, "causal_align": "bottom_right"},
    {"window": (2, 1), "scale": 0.3},
    {"softcap": 3.0},
]


@pytest.mark.parametrize("kwargs", CONFIGS)
def test_varlen_matches_dense_loop(kwargs):
    lq, lk = [3, 1, 6, 0], [5, 2, 4, 3]  # includes an empty query sequence
    q, k, v = randn(sum(lq), 4, 8), randn(sum(lk), 2, 8), randn(sum(lk), 2, 6)
    sinks = randn(4)
    out, lse = torch_steel.sdpa_varlen(
        q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), sinks=sinks, return_lse=True, **kwargs
    )
    expected_out, expected_lse = _dense_loop(q, k, v, lq, lk, sinks=sinks, **kwargs)
    torch.testing.assert_close(out, expected_out, **TOL64)
    torch.testing.assert_close(lse, expected_lse, **TOL64)


def test_varlen_gradients_match_dense_loop():
    lq, lk = [2, 4], [3, 5]
    q = randn(6, 2, 4, requires_grad=True)
    k, v = randn(8, 1, 4, requires_grad=True), randn(8, 1, 3, requires_grad=True)
    sinks = randn(2, requires_grad=True)
    kw = {"is_causal": True, "causal_align": "bottom_right", "sinks": sinks}
    out = torch_steel.sdpa_varlen(q, k, v, _cu(lq), _cu(lk), 4, 5, **kw)
    expected, _ = _dense_loop(q, k, v, lq, lk, **kw)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v, sinks), grad)
    theirs = torch.autograd.grad(expected, (q, k, v, sinks), grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **TOL64)


def test_varlen_gradcheck_with_dropout():
    q, k, v = (randn(5, 2, 3, requires_grad=True) for _ in range(3))
    cu = _cu([2, 3])

    def fn(q, k, v):
        return torch.ops.steel.sdpa_varlen(q, k, v, cu, cu, 3, 3, 0.25, True, seed=5)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_varlen_dropout_uses_sequence_index_as_batch():
    lengths = [3, 4]
    q, k, v = randn(7, 2, 4), randn(7, 2, 4), randn(7, 2, 4)
    out = torch_steel.sdpa_varlen(q, k, v, _cu(lengths), _cu(lengths), 4, 4, 0.5, seed=11)
    # Sequence b of a varlen batch draws the words of batch index b of a dense call.
    # The same sequences zero-padded into a dense [2, heads, 4, dim] batch, padding masked.
    qd, kd, vd = (torch.zeros(2, 2, 4, 4, dtype=torch.float64) for _ in range(3))
    keep = torch.zeros(2, 2, 4, 4, dtype=torch.bool)
    keep[:, :, :, :3] = True
    keep[0, :, 3, :] = False  # sequence 0 has 3 rows and 3 keys: pad rows/keys are masked
    keep[1] = True
    for b, (s, n) in enumerate([(0, 3), (3, 4)]):
        qd[b, :, :n] = q[s : s + n].transpose(0, 1)
        kd[b, :, :n] = k[s : s + n].transpose(0, 1)
        vd[b, :, :n] = v[s : s + n].transpose(0, 1)
    padded = torch_steel.sdpa(qd, kd, vd, keep, dropout_p=0.5, seed=11)
    torch.testing.assert_close(out[:3], padded[0, :, :3].transpose(0, 1), **TOL64)
    torch.testing.assert_close(out[3:], padded[1].transpose(0, 1), **TOL64)
