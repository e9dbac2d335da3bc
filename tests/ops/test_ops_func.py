"""torch.func transforms over the steel ops: grad, vjp, jacrev and vmap give what PyTorch's own
float64 ops give under the same transform; forward-mode AD and a gradient of a gradient that
has no formula are clear errors."""

import pytest
import torch
import torch.nn.functional as F
from ops_helpers import randn

import torch_steel

TOL64 = {"atol": 1e-10, "rtol": 1e-10}


def _steel_sdpa(q, k, v, mask):
    return torch_steel.sdpa(q, k, v, attn_mask=mask, scale=0.3)


def _torch_sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)


def _steel_gemm(a, b, bias, c):
    return torch_steel.gemm(a, b, bias=bias, c=c, alpha=0.5, beta=2.0, activation="gelu")


def _torch_gemm(a, b, bias, c):
    return F.gelu(0.5 * (a @ b) + 2.0 * c + bias)


def _sdpa_inputs():
    # A float mask that broadcasts over the batch: its gradient is summed back to its shape.
    return randn(2, 3, 4, 8), randn(2, 3, 5, 8), randn(2, 3, 5, 6), randn(3, 4, 5)


def _gemm_inputs():
    return randn(2, 3, 4), randn(4, 5), randn(5), randn(3, 5)


CASES = {"sdpa": (_steel_sdpa, _torch_sdpa, _sdpa_inputs), "gemm": (_steel_gemm, _torch_gemm,
         _gemm_inputs)}  # fmt: skip


def _steel_calls(fn):
    """The steel ops the dispatcher saw while fn ran: the transform reached them (else the
    comparison would be between PyTorch and itself)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("steel::")}


@pytest.mark.parametrize("op", CASES)
def test_grad_and_vjp_match_torch_autograd(op):
    steel, reference, inputs = CASES[op]
    args = inputs()
    weight = randn(*steel(*args).shape)  # a loss whose gradient is not the same everywhere
    argnums = tuple(range(len(args)))
    leaves = [x.clone().requires_grad_() for x in args]
    expected = torch.autograd.grad((reference(*leaves) * weight).sum(), leaves)
    with torch_steel.backend("reference"):
        grads = torch.func.grad(lambda *xs: (steel(*xs) * weight).sum(), argnums)(*args)
        out, vjp = torch.func.vjp(steel, *args)
        cotangents = vjp(weight)
        backward = {"sdpa": "steel::sdpa_backward", "gemm": "steel::gemm"}[op]
        assert backward in _steel_calls(lambda: torch.func.grad(lambda q: steel(q, *args[1:])
                                                                .sum())(args[0]))  # fmt: skip
    torch.testing.assert_close(out, reference(*args), **TOL64)
    for got, vjp_got, e in zip(grads, cotangents, expected, strict=True):
        torch.testing.assert_close(got, e, **TOL64)
        torch.testing.assert_close(vjp_got, e, **TOL64)


def test_jacrev_matches_torch():
    a, b, bias, c = _gemm_inputs()
    with torch_steel.backend("reference"):
        got = torch.func.jacrev(_steel_gemm, argnums=(0, 1))(a, b, bias, c)
    expected = torch.func.jacrev(_torch_gemm, argnums=(0, 1))(a, b, bias, c)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **TOL64)


def test_a_gradient_of_a_gradient():
    """gemm's backward is made of steel GEMMs, so it nests (the outer grad must see the inner
    one's forward, else the result is silently zero); sdpa_backward has no formula of its own:
    asking for its gradient is an error, not zeros."""
    a, b = randn(3, 4), randn(4, 5)

    def outer(gemm):
        return torch.func.grad(lambda a: torch.func.grad(lambda a: gemm(a, b).pow(3).sum())(a)
                               .square().sum())(a)  # fmt: skip

    with torch_steel.backend("reference"):
        got = outer(lambda a, b: torch_steel.gemm(a, b))
        q, k, v = randn(1, 2, 3, 4), randn(1, 2, 5, 4), randn(1, 2, 5, 4)
        with pytest.raises(RuntimeError, match="steel::sdpa_backward has no gradient"):
            torch.func.grad(
                lambda q: torch.func.grad(lambda q: torch_steel.sdpa(q, k, v).sum())(q).sum()
            )(q)
    torch.testing.assert_close(got, outer(torch.matmul), **TOL64)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # no batching rule: a loop
@pytest.mark.parametrize("op", CASES)
def test_vmap_matches_a_loop_over_examples(op):
    steel, reference, inputs = CASES[op]
    args = inputs()
    batched = [torch.stack([x, x.flip(0) * 0.5]) for x in args]  # two different examples
    with torch_steel.backend("reference"):
        got = torch.func.vmap(steel)(*batched)
        grads = torch.func.vmap(torch.func.grad(lambda x, *rest: steel(x, *rest).sum()))(*batched)
    for i in range(2):
        example = [x[i] for x in batched]
        torch.testing.assert_close(got[i], reference(*example), **TOL64)
        x = example[0].clone().requires_grad_()
        (expected,) = torch.autograd.grad(reference(x, *example[1:]).sum(), x)
        torch.testing.assert_close(grads[i], expected, **TOL64)


@pytest.mark.parametrize("op", CASES)
def test_forward_mode_ad_is_a_clear_error(op):
    """There is no forward-mode formula: the tangents would be dropped silently."""
    steel, _, inputs = CASES[op]
    args = inputs()
    with torch_steel.backend("reference"), pytest.raises(RuntimeError, match="forward-mode AD"):
        torch.func.jvp(lambda x: steel(x, *args[1:]), (args[0],), (torch.ones_like(args[0]),))
    with torch_steel.backend("reference"), pytest.raises(RuntimeError, match="forward-mode AD"):
        torch.func.jacfwd(lambda x: steel(x, *args[1:]))(args[0])
