"""steel::sdpa against F.scaled_dot_product_attention (float64 oracle) over a sweep."""

import pytest
import torch
import torch.nn.functional as F
from ops_helpers import randn, torch_sdpa64

import torch_steel

# float64 reference math vs PyTorch's float64 math: both exact up to summation order.
TOL64 = {"atol": 1e-10, "rtol": 1e-10}


def _mask(kind, shape, L, S):
    if kind == "none":
        return None
    if kind == "bool":
        return torch.rand(*shape, L, S) > 0.3
    return torch.randn(*shape, L, S, dtype=torch.float64)


# PyTorch refuses is_causal together with an explicit mask, so causal runs without one.
CASES = [
    (L_S, kind, shape, causal)
    for L_S in [(5, 5), (3, 7), (7, 3), (1, 9)]  # square, L < S, L > S, a decode row
    for kind in ["none", "bool", "float"]
    for shape in ([()] if kind == "none" else [(), (4,), (2, 1)])  # broadcast to [2, 4, L, S]
    for causal in ([False, True] if kind == "none" else [False])
]


@pytest.mark.parametrize("L_S,mask_kind,mask_shape,is_causal", CASES)
def test_sdpa_matches_torch(L_S, mask_kind, mask_shape, is_causal):
    L, S = L_S
    q, k, v = randn(2, 4, L, 8), randn(2, 4, S, 8), randn(2, 4, S, 8)
    mask = _mask(mask_kind, mask_shape, L, S)
    out = torch.ops.steel.sdpa(q, k, v, mask, is_causal=is_causal)
    torch.testing.assert_close(out, torch_sdpa64(q, k, v, mask, is_causal=is_causal), **TOL64)


@pytest.mark.parametrize("L,S", [(4, 6), (6, 4)])
def test_sdpa_gradients_match_torch(L, S):
    q = randn(2, 4, L, 8, requires_grad=True)
    k, v = randn(2, 2, S, 8, requires_grad=True), randn(2, 2, S, 5, requires_grad=True)
    mask = torch.randn(1, 4, L, S, dtype=torch.float64)
    out = torch.ops.steel.sdpa(q, k, v, mask, scale=0.3, enable_gqa=True)
    ref = torch_sdpa64(q, k, v, mask, scale=0.3, enable_gqa=True)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **TOL64)


def test_sdpa_gqa_scale_and_value_dim():
    q, k, v = randn(3, 6, 5, 16), randn(3, 2, 9, 16), randn(3, 2, 9, 4)
    out = torch.ops.steel.sdpa(q, k, v, scale=0.17, enable_gqa=True)
    assert out.shape == (3, 6, 5, 4)
    torch.testing.assert_close(out, torch_sdpa64(q, k, v, scale=0.17, enable_gqa=True), **TOL64)


def test_sdpa_fully_masked_rows_are_zero():
    q, k, v = randn(1, 2, 4, 8), randn(1, 2, 5, 8), randn(1, 2, 5, 8)
    mask = torch.rand(1, 2, 4, 5) > 0.5
    mask[:, :, 1] = False
    additive = torch.zeros(4, 5, dtype=torch.float64)
    additive[2] = float("-inf")
    for m in (mask, additive):
        out, lse = torch_steel.sdpa(q, k, v, m, return_lse=True)
        torch.testing.assert_close(out, torch_sdpa64(q, k, v, m), **TOL64)
        assert torch.isfinite(out).all()
    assert (out[:, :, 2] == 0).all() and torch.isneginf(lse[:, :, 2]).all()


def test_sdpa_fully_masked_rows_have_zero_gradient():
    q = randn(1, 1, 3, 4, requires_grad=True)
    k, v = randn(1, 1, 3, 4, requires_grad=True), randn(1, 1, 3, 4, requires_grad=True)
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[0] = False
    torch.ops.steel.sdpa(q, k, v, mask).sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[0, 0, 0] == 0).all()


@pytest.mark.parametrize(
    "q_shape,kv_shape,gqa",
    [
        ((2, 3, 4, 8), (1, 3, 5, 8), False),  # batch broadcast
        ((2, 3, 4, 8), (3, 5, 8), False),  # lower-rank key/value
        ((2, 3, 4, 8), (2, 1, 5, 8), False),  # one key/value head broadcast to all
        ((1, 3, 4, 8), (2, 3, 5, 8), False),  # query broadcast
        ((3, 2, 6, 4, 8), (2, 1, 5, 8), True),  # 5-D with grouped heads
    ],
)
def test_sdpa_broadcasts_leading_dims_like_torch(q_shape, kv_shape, gqa):
    q = randn(*q_shape, requires_grad=True)
    k, v = randn(*kv_shape, requires_grad=True), randn(*kv_shape, requires_grad=True)
    out = torch.ops.steel.sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
    expected = torch_sdpa64(q, k, v, is_causal=True, enable_gqa=gqa)
    torch.testing.assert_close(out, expected, **TOL64)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(expected, (q, k, v), grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **TOL64)


def test_sdpa_three_and_two_dim_inputs():
    q, k, v = randn(3, 5, 8), randn(3, 6, 8), randn(3, 6, 8)  # [heads, L, E]
    torch.testing.assert_close(torch.ops.steel.sdpa(q, k, v), torch_sdpa64(q, k, v), **TOL64)
    q2, k2, v2 = q[0], k[0], v[0]  # [L, E]
    torch.testing.assert_close(torch.ops.steel.sdpa(q2, k2, v2), torch_sdpa64(q2, k2, v2), **TOL64)
    out, lse = torch_steel.sdpa(q2, k2, v2, return_lse=True)
    assert out.shape == (5, 8) and lse.shape == (5,)


@pytest.mark.parametrize(
    "dtype,atol",
    [
        # fp32 math end to end: a few ulps of the O(1) outputs.
        (torch.float32, 1e-5),
        # fp16/bf16 inputs, fp32 math, rounded output: half an ulp of |out| <= ~3.
        (torch.float16, 4e-3),
        (torch.bfloat16, 3e-2),
    ],
)
def test_sdpa_low_precision_against_float64(dtype, atol):
    q, k, v = randn(2, 3, 17, 32), randn(2, 3, 23, 32), randn(2, 3, 23, 32)
    lo = [t.to(dtype) for t in (q, k, v)]
    out = torch.ops.steel.sdpa(*lo, is_causal=True)
    assert out.dtype == dtype
    # Compare with the float64 result on the rounded inputs, isolating the op's own error.
    expected = torch_sdpa64(*lo, is_causal=True)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)


def test_sdpa_backward_op_gradcheck():
    """float64 gradcheck of sdpa_forward's autograd, i.e. of the sdpa_backward op."""
    q = randn(1, 2, 4, 3, requires_grad=True)
    k, v = randn(1, 1, 5, 3, requires_grad=True), randn(1, 1, 5, 2, requires_grad=True)
    sinks = randn(2, requires_grad=True)
    mask = torch.randn(4, 5, dtype=torch.float64)

    def fn(q, k, v, sinks):
        out, lse = torch.ops.steel.sdpa_forward(
            q, k, v, mask, 0.0, True, 0.4, sinks, 2.0, 2, -1, True, 0, 0
        )
        return out, lse

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


@pytest.mark.parametrize("mask_shape", [(4, 5), (2, 1, 5), (1, 2, 4, 5)], ids=["LS", "H1S", "1HLS"])
def test_sdpa_float_mask_gradient(mask_shape):
    """A learnable additive mask (T5 / ALiBi-style bias) gets its gradient, summed over the
    dims it broadcasts along: gradcheck, and PyTorch's own gradients."""
    q, k, v = randn(1, 2, 4, 3), randn(1, 2, 5, 3), randn(1, 2, 5, 3)
    mask = randn(*mask_shape, requires_grad=True)

    def fn(mask, q):
        return torch.ops.steel.sdpa(q, k, v, mask, is_causal=True, softcap=3.0)

    q.requires_grad_(True)
    assert torch.autograd.gradcheck(fn, (mask, q))
    out = torch.ops.steel.sdpa(q, k, v, mask)
    expected = F.scaled_dot_product_attention(q, k, v, mask)
    go = torch.randn_like(out)
    (dmask, dq) = torch.autograd.grad(out, (mask, q), go)
    (emask, eq) = torch.autograd.grad(expected, (mask, q), go)
    torch.testing.assert_close(dmask, emask, rtol=1e-10, atol=1e-12)  # float64: rounding only
    torch.testing.assert_close(dq, eq, rtol=1e-10, atol=1e-12)


def test_sdpa_dropout_backward_gradcheck():
    """With a fixed seed the mask is a pure function: gradcheck sees the same mask each call."""
    q = randn(1, 2, 4, 3, requires_grad=True)
    k, v = randn(1, 2, 6, 3, requires_grad=True), randn(1, 2, 6, 3, requires_grad=True)

    def fn(q, k, v):
        return torch.ops.steel.sdpa(q, k, v, dropout_p=0.3, seed=1234, offset=7)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_sdpa_matches_torch_nn_multihead_attention_under_patch(steel_calls):
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).double().eval()
    x = randn(2, 7, 16)
    expected, _ = mha(x, x, x, need_weights=False, is_causal=False)
    with torch_steel.backend("reference"), torch_steel.patch(devices=("mps", "cpu")):
        got, _ = mha(x, x, x, need_weights=False)
    assert steel_calls == ["forward"]
    torch.testing.assert_close(got, expected, **TOL64)


def test_sdpa_float32_matches_torch_float32():
    q, k, v = (torch.randn(2, 2, 9, 16) for _ in range(3))
    torch.testing.assert_close(
        torch.ops.steel.sdpa(q, k, v, is_causal=True),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
        atol=1e-5,
        rtol=1e-5,
    )


def _steel_dispatches(fn):
    """The steel op calls that the dispatcher saw while fn ran (one per pass through it)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("steel::")]


def test_a_call_with_grad_passes_the_dispatcher_once():
    """With a gradient wanted, the Autograd kernel's Function runs the implementation itself
    (as without one); with something below autograd (here a TorchDispatchMode) the call is
    redispatched there, and the gradients are the same either way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = (torch.randn(1, 2, 3, 8, requires_grad=True) for _ in range(3))
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    calls = {
        "steel::sdpa_forward": lambda: torch_steel.sdpa(q, k, v, is_causal=True),
        "steel::gemm": lambda: torch_steel.gemm(a, b, activation="gelu"),
    }
    for name, call in calls.items():
        with torch_steel.backend("reference"):
            assert _steel_dispatches(call) == [name]
            inputs = (q, k, v) if name == "steel::sdpa_forward" else (a, b)
            expected = torch.autograd.grad(call().sum(), inputs)
            mode = Seen()
            with mode:
                out = call()
            assert f"{name[7:]}.default" in " ".join(mode.ops)  # redispatched below autograd
            for g, e in zip(torch.autograd.grad(out.sum(), inputs), expected):
                torch.testing.assert_close(g, e, atol=0, rtol=0)


class _Subclass(torch.Tensor):
    pass


class _ParameterSubclass(torch.nn.Parameter):
    pass


class _SeenModes(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _FunctionMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _within(context):
    """Runs a call inside a fresh context(), returning its result."""

    def run(call):
        with context():
            return call()

    return run


def _profiler():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU])


# How each call is made: (wrap the inputs, run the call), and whether the dispatcher must see it.
_HOOKS = {
    "plain": (lambda t: t, lambda call: call(), False),
    "no_grad over inputs requiring grad": (
        lambda t: t.requires_grad_(),
        _within(torch.no_grad),
        False,
    ),
    "an input requiring grad": (lambda t: t.requires_grad_(), lambda call: call(), False),
    "a Parameter": (torch.nn.Parameter, lambda call: call(), False),
    "a subclass of Parameter": (
        lambda t: torch.nn.Parameter(t).as_subclass(_ParameterSubclass),
        lambda call: call(),
        True,
    ),
    "a tensor subclass": (lambda t: t.as_subclass(_Subclass), lambda call: call(), True),
    # Reads as t, its memory holds -t: the dispatcher materializes it before the op runs.
    "a negated view": (lambda t: torch._neg_view(t.neg()), lambda call: call(), True),
    "below autograd, inputs requiring grad": (
        lambda t: t.requires_grad_(),
        _within(torch._C._AutoDispatchBelowAutograd),
        False,
    ),
    "a meta tensor": (lambda t: t.to("meta"), lambda call: call(), True),
    "a dispatch mode": (lambda t: t, _within(_SeenModes), True),
    "a function mode": (lambda t: t, _within(_FunctionMode), True),
    "the profiler": (lambda t: t, _within(_profiler), True),
    "autocast": (lambda t: t, _within(lambda: torch.autocast("cpu", torch.bfloat16)), True),
    "a functorch transform": (
        lambda t: t,
        lambda call: torch.func.vmap(lambda _: call())(torch.zeros(1)),
        True,
    ),
    "a JIT trace": (lambda t: t, lambda call: torch.jit.trace(call, ()), True),
}


_GRADIENT_HOOKS = ("an input requiring grad", "a Parameter", "a subclass of Parameter")


@pytest.mark.parametrize("hook", _HOOKS)
@pytest.mark.parametrize("op", ["sdpa", "sdpa_varlen", "gemm"])
def test_the_dispatcher_is_skipped_only_where_it_would_do_nothing_else(hook, op, monkeypatch):
    """torch_steel.sdpa and gemm call what the dispatcher would call (the op's implementation,
    or with a gradient the op's autograd Function around it) themselves when the dispatcher
    would hand it the call untouched (issue 16: its pass is about 10 us of a decode call), and
    call the op through it whenever something hooks the call: a subclass, a device with its own
    kernel (meta), a mode, the profiler, autocast, a transform, a JIT trace. The results and
    the gradients are the same either way."""
    from torch_steel import ops

    wrap, run, through_dispatcher = _HOOKS[hook]
    entered = []
    module, name = {"sdpa": (ops.attention_ops, "_SDPA_FORWARD_CALLS"),
                    "sdpa_varlen": (ops.varlen_ops, "_SDPA_VARLEN_FORWARD_CALLS"),
                    "gemm": (ops.gemm_ops, "_GEMM_CALLS")}[op]  # fmt: skip
    entry, *undispatched = getattr(module, name)  # the first: through the dispatcher
    counted = (lambda *args: entered.append(1) or entry(*args), *undispatched)
    monkeypatch.setattr(module, name, counted)
    g = torch.Generator().manual_seed(0)
    if op == "sdpa":
        inputs = [torch.randn(1, 2, 3, 8, generator=g) for _ in range(3)]
        expected = F.scaled_dot_product_attention(*inputs, is_causal=True)
        steel = torch_steel.sdpa
        kwargs = {"is_causal": True}
    elif op == "sdpa_varlen":  # two sequences of 3 and 2 tokens
        inputs = [torch.randn(5, 2, 8, generator=g) for _ in range(3)]
        cu = torch.tensor([0, 3, 5], dtype=torch.int32)
        rows = [inputs[i].transpose(0, 1) for i in range(3)]
        expected = torch.cat(
            [
                F.scaled_dot_product_attention(*(t[:, a:b] for t in rows))
                for a, b in ((0, 3), (3, 5))
            ],
            dim=1,
        ).transpose(0, 1)

        def steel(q, k, v):
            return torch_steel.sdpa_varlen(q, k, v, cu, cu, 3, 3)

        kwargs = {}
    else:
        inputs = [torch.randn(3, 4, generator=g), torch.randn(4, 5, generator=g)]
        expected = inputs[0] @ inputs[1]
        steel = torch_steel.gemm
        kwargs = {}
    wrapped = [wrap(t.clone()) for t in inputs]
    with torch_steel.backend("reference"):
        out = run(lambda: steel(*wrapped, **kwargs))
        if hook in _GRADIENT_HOOKS:  # against PyTorch's gradients of the same inputs
            # the op's own gradient (the kernels'), not autograd's through the reference math
            assert type(out.grad_fn).__name__.endswith("_autogradBackward")
            leaves = [t.detach().requires_grad_() for t in inputs]
            reference = {"sdpa": lambda: F.scaled_dot_product_attention(*leaves, is_causal=True),
                         "gemm": lambda: leaves[0] @ leaves[1]}  # fmt: skip
            if op in reference:
                weights = torch.randn(expected.shape, generator=g)
                got = torch.autograd.grad((out * weights).sum(), wrapped)
                want = torch.autograd.grad((reference[op]() * weights).sum(), leaves)
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert bool(entered) == through_dispatcher  # (a JIT trace runs the call twice)
    if hook == "below autograd, inputs requiring grad":  # as the dispatcher would: no gradient
        assert not out.requires_grad
    if hook == "a JIT trace":
        out = out()
    if hook == "a meta tensor":
        assert out.device.type == "meta" and out.shape == expected.shape
        return
    out = out.squeeze(0) if hook == "a functorch transform" else out
    tol = {"atol": 2e-2, "rtol": 2e-2} if hook == "autocast" else {"atol": 1e-5, "rtol": 1e-5}
    assert out.dtype == (torch.bfloat16 if hook == "autocast" else torch.float32)
    torch.testing.assert_close(out.float().detach(), expected, **tol)
