"""GEMM: torch.ops.steel.gemm and torch_steel.gemm / linear (see torch_steel.ops for the op's
contract), with its autograd (steel GEMMs for the gradients).
"""

import torch

from .. import reference as ref
from .. import validation as check
from ..backends import backend, current_backend, run
from .registry import _FUNCTIONS, _define, _undispatched

# ----------------------------------------------------------------------------- gemm


def _gemm(a, b, bias=None, c=None, alpha=1.0, beta=0.0, activation="none"):
    check.check_gemm(a, b, bias, c, activation)
    return _gemm_prechecked(a, b, bias, c, alpha, beta, activation)


def _gemm_prechecked(a, b, bias=None, c=None, alpha=1.0, beta=0.0, activation="none"):
    (out,) = run(
        "gemm",
        [a, b, bias, c],
        {"alpha": alpha, "beta": beta, "activation": activation},
        lambda: [ref.gemm(a, b, bias, c, alpha, beta, activation)],
    )
    return out


def _gemm_fake(a, b, bias=None, c=None, alpha=1.0, beta=0.0, activation="none"):
    check.check_gemm(a, b, bias, c, activation)
    return a.new_empty(check.gemm_out_shape(a, b))


_GEMM_DEFAULTS = (None, None, 1.0, 0.0, "none")  # bias ... activation


def _gemm_setup(ctx, inputs, output):
    # The dispatcher drops trailing arguments left at their defaults: restore them.
    inputs = (*inputs, *_GEMM_DEFAULTS[len(inputs) - 2 :])
    a, b, bias, c, ctx.alpha, ctx.beta, ctx.activation = inputs
    ctx.backend = current_backend()
    ctx.save_for_backward(a, b, bias, c)


def _gemm_backward(ctx, grad):
    a, b, bias, c = ctx.saved_tensors
    # The dispatcher drops trailing arguments left at their defaults, so needs_input_grad can be
    # shorter than the schema: pad it.
    needs = (*ctx.needs_input_grad, False, False, False, False)
    gemm_op = torch.ops.steel.gemm
    da = db = dbias = dc = None
    with backend(ctx.backend):  # the backward GEMMs are steel GEMMs too
        if ctx.activation == "none":
            dz = grad
        else:  # recompute the pre-activation (one more GEMM) instead of keeping it alive
            z = gemm_op(a, b, bias, c, ctx.alpha, ctx.beta)
            ct = ref.compute_dtype(z.dtype)
            dz = (grad.to(ct) * ref.activation_grad(z.to(ct), ctx.activation)).to(grad.dtype)
        if needs[0]:
            da = gemm_op(dz, b.mT, alpha=ctx.alpha).sum_to_size(a.shape)
        if needs[1]:
            db = gemm_op(a.mT, dz, alpha=ctx.alpha).sum_to_size(b.shape)
    if needs[2]:
        dbias = dz.reshape(-1, dz.shape[-1]).sum(0)
    if needs[3]:
        dc = (dz * ctx.beta).sum_to_size(c.shape)
    return da, db, dbias, dc, None, None, None


_define(
    "gemm",
    "(Tensor a, Tensor b, Tensor? bias=None, Tensor? c=None, float alpha=1.0, float beta=0.0, "
    'str activation="none") -> Tensor',
    _gemm,
    _gemm_fake,
    (0, 1, 2, 3),
    _gemm_setup,
    _gemm_backward,  # steel GEMMs for the gradients
    _gemm_prechecked,
)
_GEMM = torch.ops.steel.gemm.default
_GEMM_PRECHECKED = torch.ops.steel.gemm_prechecked.default
_GEMM_CALLS = (_GEMM._op, _gemm, _FUNCTIONS["gemm"])  # as attention_ops._SDPA_FORWARD_CALLS


def gemm(a, b, *, bias=None, c=None, alpha=1.0, beta=0.0, activation="none"):
    """act(alpha * (a @ b) + beta * c + bias); a [..., M, K], b [..., K, N], bias [N].

    Batch dims broadcast like torch.matmul; c broadcasts to the output and is ignored when
    beta == 0 (like addmm); activation is none, relu, gelu, gelu_tanh or silu; fp32 accumulation
    for float16/bfloat16. Same as torch.ops.steel.gemm(a, b, bias, c, alpha, beta, activation).
    """
    if torch.compiler.is_compiling():  # see registry._define
        return _GEMM_PRECHECKED(a, b, bias, c, float(alpha), float(beta), activation)
    how = _undispatched(a, b, bias, c)  # what the dispatcher would call, if nothing else
    return _GEMM_CALLS[how](a, b, bias, c, float(alpha), float(beta), activation)


def linear(x, weight, bias=None, activation="none"):
    """act(x @ weight.T + bias) through steel::gemm (weight [out, in], as nn.Linear)."""
    if not torch.is_tensor(x) or x.dim() < 1:
        raise ValueError("steel.linear: x must be a tensor of shape [..., in_features]")
    if not torch.is_tensor(weight) or weight.dim() != 2:
        raise ValueError("steel.linear: weight must be [out_features, in_features]")
    if x.dim() == 1:
        return gemm(x.unsqueeze(0), weight.t(), bias=bias, activation=activation).squeeze(0)
    return gemm(x, weight.t(), bias=bias, activation=activation)
