"""The steel ops: torch.ops.steel.{sdpa, sdpa_varlen, gemm} and their internal pieces.

Public ops (wrapped, with a friendlier signature, as torch_steel.sdpa / sdpa_varlen / gemm):
  steel::sdpa         F.scaled_dot_product_attention plus keyword-only extensions. Composite:
                      validates, resolves scale and the dropout seed, calls sdpa_forward.
  steel::sdpa_varlen  packed variable-length attention, composite over sdpa_varlen_forward.
  steel::gemm         gemm(a, b, bias=None, c=None, alpha=1.0, beta=0.0, activation="none") =
                      act(alpha * (a @ b) + beta * c + bias). (The op's tensors are positional;
                      torch_steel.gemm takes them keyword-only.)
Internal ops, what the Metal kernels implement; autograd connects forward to backward:
  steel::sdpa_forward(q, k, v, attn_mask, <attention options>) -> (out, lse)
  steel::sdpa_backward(grad_out, grad_lse, q, k, v, out, lse, attn_mask, mask_grad, <options>)
      -> (dq, dk, dv, dsinks, dmask)   (dsinks is empty when there are no sinks, dmask unless
      mask_grad asks for the gradient of a float attn_mask, in the mask's shape)
  steel::sdpa_varlen_forward / steel::sdpa_varlen_backward: the same over packed tensors, with
      cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k in place of attn_mask.
  steel::sdpa_paged_forward(q, k_pool, v_pool, cu_seqlens_q, block_table, seqused_k,
      max_seqlen_q, max_seqlen_k, <attention options>) -> (out, lse): varlen against a paged KV
      cache (inference: no autograd).
  steel::sdpa_quantized_forward(q, k, k_scales, k_mins, v, v_scales, v_mins, k_format,
      v_format, attn_mask, <attention options>), steel::sdpa_varlen_quantized_forward(q, <the
      same six tensors and two formats>, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
      max_seqlen_q, max_seqlen_k, <options>): quantized K/V (torch_steel.kv), inference only.
  <attention options> = dropout_p, is_causal, scale, sinks, softcap, window_left, window_right,
      bottom_right, seed, offset, num_splits (all resolved: see Attn and torch_steel.reference).
  steel::sdpa_forward_prechecked, steel::gemm_prechecked: sdpa_forward and gemm without the
      input checks and without defaults, which the public functions call while torch.compile
      traces them: the checks run in the fake implementations when the graph is traced.

Every op goes through torch_steel.backends.run with these run_op names and arguments. Absent
tensors are None. Outputs are contiguous, except sdpa's `out`, which has the query's memory
layout as in F.scaled_dot_product_attention (torch_steel.reference.layout_strides: a
[B, L, H, E] query viewed as [B, H, L, E] gives an out with [B, L, H, Ev]-ordered strides).
The fake implementations say so and the kernels must write that layout (sdpa_forward copies an
out of any other layout into it):
  "sdpa"                  [q, k, v, attn_mask, sinks] -> [out, lse]
  "sdpa_backward"         [grad_out, q, k, v, out, lse, attn_mask, sinks, grad_lse]
                          -> [dq, dk, dv] + [dsinks] when sinks is given + [dmask] when the
                          option mask_grad is true
  "sdpa_varlen"           [q, k, v, cu_seqlens_q, cu_seqlens_k, sinks] -> [out, lse], or
                          [q, k_pool, v_pool, cu_seqlens_q, None, sinks, block_table, seqused_k]
                          over a paged KV cache (steel::sdpa_paged_forward)
  "sdpa_varlen_backward"  [grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks,
                          grad_lse] -> [dq, dk, dv] + [dsinks]
      options: dropout_p, is_causal, scale, softcap (0 = off), window_left, window_right
      (-1 = unbounded), bottom_right, offset, seed_lo, seed_hi (the 64-bit seed in 32-bit halves:
      option numbers are doubles), num_splits (decode key partitions, 0 = the plan's choice);
      varlen adds max_seqlen_q, max_seqlen_k.
      lse is float32 [*batch, Hq, L] ([Hq, total_q] for varlen; float64 for float64 inputs).
  "sdpa_quantized"        [q, k, k_scales, k_mins, v, v_scales, v_mins, attn_mask, sinks]
                          -> [out, lse]; options of "sdpa" plus k_format, v_format
  "sdpa_varlen_quantized" [q, k, k_scales, k_mins, v, v_scales, v_mins, cu_seqlens_q,
                          cu_seqlens_k, sinks, block_table, seqused_k] -> [out, lse]
  "gemm"                  [a, b, bias, c] -> [out]; options alpha, beta, activation.
"""

import math
import operator
import re
from typing import NamedTuple

import torch
from torch import Tensor
from torch._functorch.utils import enable_single_level_autograd_function
from torch.autograd.forward_ad import _set_fwd_grad_enabled
from torch.nn import Parameter

from . import inductor
from . import kv as qkv
from . import reference as ref
from . import validation as check
from .backends import backend, current_backend, run
from .kv import QuantizedKV

_LIB = torch.library.Library("steel", "FRAGMENT")  # holds the composite ops defined below

_OPTIONS = (
    "float dropout_p, bool is_causal, float scale, Tensor? sinks, float softcap, "
    "int window_left, int window_right, bool bottom_right, int seed, int offset, "
    "int num_splits=0"
)
# The same with Attn's defaults, which sdpa_forward's callers leave out (its common case).
_OPTIONS_DEFAULTS = (
    "float dropout_p, bool is_causal, float scale, Tensor? sinks=None, float softcap=0.0, "
    "int window_left=-1, int window_right=-1, bool bottom_right=False, int seed=0, int offset=0, "
    "int num_splits=0"
)
_VARLEN = "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k"
_EXTENSIONS = (
    'Tensor? sinks=None, float softcap=0.0, int[]? window=None, str causal_align="top_left", '
    "int? seed=None, int offset=0"
)


class Attn(NamedTuple):
    """Resolved attention options, in the order the internal ops and the reference take them."""

    dropout_p: float
    is_causal: bool
    scale: float
    # The defaults of sdpa_forward's schema: the dispatcher leaves out trailing arguments at
    # their defaults when it calls a Python kernel.
    sinks: Tensor | None = None
    softcap: float = 0.0
    window_left: int = -1
    window_right: int = -1
    bottom_right: bool = False
    seed: int = 0
    offset: int = 0
    num_splits: int = 0  # decode key partitions: 0 lets the plan choose, 1 is one pass

    def math(self):
        """The options the reference takes (everything but num_splits, which changes only how
        the kernels split the work)."""
        return tuple(self)[:-1]

    def run_options(self, **extra):
        """run_op options: sinks is a tensor argument, the seed travels as two 32-bit halves."""
        seed = self.seed
        return {
            "dropout_p": self.dropout_p,
            "is_causal": self.is_causal,
            "scale": self.scale,
            "softcap": self.softcap,
            "window_left": self.window_left,
            "window_right": self.window_right,
            "bottom_right": self.bottom_right,
            "offset": self.offset,
            "num_splits": self.num_splits,
            "seed_lo": seed & 0xFFFFFFFF,
            "seed_hi": seed >> 32,
            **extra,
        }


def _resolve(op, head_dim, dropout_p, is_causal, scale, sinks, softcap, window, causal_align,
             seed, offset):  # fmt: skip
    """Checks the public options and resolves the defaults (scale, dropout seed) to an Attn."""
    if (dropout_p == 0.0 and not softcap and window is None and causal_align == "top_left"
            and seed is None and offset == 0):  # fmt: skip
        softcap, left, right, bottom_right = 0.0, -1, -1, False  # the defaults: nothing to check
    else:
        softcap, left, right, bottom_right = check.attention_options(
            op, dropout_p, softcap, window, causal_align, seed, offset
        )
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if dropout_p == 0.0:
        seed = 0
    elif seed is None:  # torch's default generator, so torch.manual_seed makes runs repeatable
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
    return Attn(float(dropout_p), bool(is_causal), float(scale), sinks, softcap, left, right,
                bottom_right, seed, offset)  # fmt: skip


def _dsinks(grads, attn, like):
    """The op's 4th output: dsinks, or an empty tensor when there are no sinks."""
    return grads[3] if attn.sinks is not None else like.new_empty(0)


def _sinks_fake(sinks, like):
    return sinks.new_empty(sinks.shape) if sinks is not None else like.new_empty(0)


# The dispatch key sets below autograd of plain tensors of a device whose kernel is the
# CompositeExplicitAutograd impl of _define (no op registers a kernel of its own there), as raw
# bits: comparing DispatchKey enums from Python costs microseconds.
_IMPL_KEYSETS = frozenset(
    torch._C.DispatchKeySet(key).raw_repr()
    for key in (torch._C.DispatchKey.CPU, torch._C.DispatchKey.MPS, torch._C.DispatchKey.CUDA)
)


_C_APPLY = torch._C._FunctionBase.__dict__["apply"]  # what torch.autograd.Function.apply ends in


# How _undispatched says to call an op, 0 being through the dispatcher: each public function
# keeps a tuple of the three calls in this order (its overload's entry, the implementation, the
# op's Function) and indexes it with the answer.
_IMPL, _FUNCTION = 1, 2
_AUTOGRAD = torch._C.DispatchKey.AutogradFunctionality


def _undispatched(*tensors):
    """How the dispatcher would hand an op call on these tensors (None for an absent one) on,
    when all it would do is hand it on, so that the public functions may make that call
    themselves: _IMPL, the op's implementation; _FUNCTION, the op's autograd Function around
    it (_FUNCTIONS), as its Autograd kernel applies it when a gradient is wanted; else 0.

    The dispatcher's pass costs about 10 us of a decode call's host time (its arguments and
    results converted between Python and C++ twice, issue 16). It does nothing else when the
    tensors are plain CPU or MPS tensors or Parameters (which dispatch as plain tensors; a
    subclass, FakeTensor or FunctionalTensor, a negated view or a ZeroTensor takes the
    dispatcher) and nothing active hooks the call: no functorch transform, dispatch or function
    mode, profiler (which records the op's pass), autocast (which casts the inputs at the op:
    _register_autocast) or JIT trace. Below autograd (_AutoDispatchBelowAutograd) a call that
    wants a gradient gets the implementation, as the dispatcher would give it.
    """
    grad = torch.is_grad_enabled()
    how = _IMPL
    for t in tensors:
        if t is not None:
            if (
                (type(t) is not Tensor and type(t) is not Parameter)
                or not (t.is_mps or t.is_cpu)
                or t.is_neg()  # a view whose negation (or zeros) the dispatcher materializes
                or t._is_zerotensor()
            ):
                return 0
            if grad and t.requires_grad:
                how = _FUNCTION
    if (
        torch._C._are_functorch_transforms_active()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._autograd._profiler_enabled()
        or torch._C._is_any_autocast_enabled()
        or torch._C._get_tracing_state()
    ):
        return 0
    if how == _FUNCTION and torch._C._dispatch_tls_is_dispatch_key_excluded(_AUTOGRAD):
        return _IMPL  # below autograd (_AutoDispatchBelowAutograd): the dispatcher skips it
    return how


# op name -> its autograd Function's apply around its implementation (ops with a gradient).
_FUNCTIONS = {}


def _check_transform(name):
    """Forward-mode AD has no formula here: the op would run on the primals alone, silently
    dropping the tangents (torch.func.jvp's transform is the innermost one whenever this op runs
    under it, nested in vmap or grad or not)."""
    interpreter = torch._C._functorch.peek_interpreter_stack()
    if interpreter is not None and interpreter.key() == torch._C._functorch.TransformType.Jvp:
        raise RuntimeError(
            f"steel::{name} does not support forward-mode AD (torch.func.jvp, jacfwd, hessian); "
            "torch.func.grad, vjp, jacrev and vmap are supported"
        )


def _graph_call(op, impl):
    """The call of `op` in a compiled graph's code (torch_steel.inductor): `impl` itself when
    the dispatcher would call nothing else, as for an eager call (inside the graph autograd is
    off, or the graph is an inference one), else the overload's C++ entry point."""
    entry = op._op
    positions = tuple(
        i
        for i, argument in enumerate(op._schema.arguments)
        if argument.type.isSubtypeOf(torch._C.OptionalType.ofTensor())
    )
    last, tensors = positions[-1], operator.itemgetter(*positions)

    def call(*args):
        if len(args) > last and _undispatched(*tensors(args)) == _IMPL:
            return impl(*args)
        return entry(*args)

    return call


def _define(name, schema, impl, fake, tensors, setup=None, backward=None, prechecked=None,
            why=None):  # fmt: skip
    """Defines steel::<name> with torch.library.Library: `impl` on every device, `fake` for
    tracing, and an Autograd kernel (`tensors`: the positions of the tensor arguments).

    With `prechecked` (impl without the input checks), also steel::<name>_prechecked, the same
    op for the graphs of torch.compile, which the public functions call while dynamo traces
    them: its fake implementation checks the inputs when the graph is traced, and the graph's
    guards keep them what they were, so the compiled call goes straight to the backend. A
    compiled graph runs the op's Python more slowly than eager code does (the caches are cold
    after the graph's runtime wrappers), so work skipped there counts double (issue 16); for
    the same reason inductor's code calls every op here as `_graph_call` (torch_steel.inductor).

    With `setup` and `backward`, a call that wants a gradient applies a torch.autograd.Function
    (the op below autograd, `setup` as its setup_context, `backward` for the gradients). Without
    them the op has no gradient (the backward ops, the paged KV cache's inference-only forward):
    a call that wants one is an error, raised before any work (inside a torch.func transform,
    which differentiates with create_graph, when the gradient's own gradient is asked for);
    `why` says why there is none.

    What torch.library.custom_op registers, without its Python layers around every call
    (about 15 us of host time per call, more than the whole call costs otherwise: issue 16).
    When nothing but a device kernel, which is `impl`, is left below autograd, the Autograd
    kernel calls `impl` itself (with a gradient, as the Function's forward): a second pass
    through the dispatcher converts every argument twice more. Anything else below autograd
    (fake tensors, functionalization, a tensor subclass or mode) gets the call redispatched.
    """
    _LIB.define(name + schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"steel::{name}", fake, lib=_LIB)
    op = getattr(torch.ops.steel, name).default
    after_autograd = torch._C._after_autograd_keyset
    after_autograd_bits = after_autograd.raw_repr()  # ANDed as ints: no keyset object per call

    def below_autograd(*args):
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    def no_gradient(*_):
        raise RuntimeError(
            f"steel::{name} has no gradient{f' ({why})' if why else ''}: call it on tensors "
            "that do not require grad (or under torch.no_grad())"
        )

    def function(forward, how, setup, backward):
        return type(f"_{name}_autograd", (torch.autograd.Function,), {
            "__doc__": f"steel::{name}'s autograd: {how}, {backward.__name__} for the "
                       "gradients.",
            "forward": staticmethod(forward),
            "setup_context": staticmethod(setup),
            "backward": staticmethod(backward),
        })  # fmt: skip

    if backward is not None:
        # A call with a gradient passes the dispatcher once, like one without: the Function's
        # forward is `impl` itself when nothing but a device kernel is below autograd and no
        # functorch transform is active, applied by autograd's C++ apply: Function.apply binds
        # the arguments to forward's signature with inspect first (about 30 us per call),
        # which a forward of *args without defaults does not need.
        direct = _C_APPLY.__get__(None, function(impl, "impl itself", setup, backward))
        _FUNCTIONS[name] = direct
        below_rules = (setup, backward)
        redispatched = function(below_autograd, "the op below autograd", *below_rules).apply
    else:
        direct = redispatched = no_gradient
        # Inside a torch.func transform the gradients are computed with create_graph (so that
        # transforms nest), which makes a backward op's inputs require grad: the error waits
        # until its gradient is asked for, in the gradient's backward.
        below_rules = (lambda *_: None, no_gradient)

    # Inside a torch.func transform (grad, vjp, jacrev) this kernel runs on the transform's
    # tensor wrappers, within the transform's layer of the dispatcher. Function.apply would hand
    # the call to functorch's custom_function_call, which enters the transform's layer itself
    # and has no kernel from within it (at Autograd): the C++ apply records the gradient on the
    # wrappers, as the Autograd kernel of a built-in op does. Its forward reaches the layer's
    # back end (unwrap, the transform below, wrap): a function of one transform level, which
    # functorch's own grad rule for autograd.Function applies with the same permission.
    # Autograd's apply turns gradients off for the forward, and the transform below (an outer
    # grad, say) keeps that mode: turned back on, as in functorch's rule, so that the outer
    # transform records the op too (else a gradient of a gradient is silently zero).
    def forward_in_transform(*args):
        with torch.enable_grad(), _set_fwd_grad_enabled(True):
            return below_autograd(*args)

    in_transform = function(forward_in_transform, "the op in a torch.func transform", *below_rules)
    below_apply = _C_APPLY.__get__(None, in_transform)

    def transformed(*args):
        _check_transform(name)
        with enable_single_level_autograd_function():
            return below_apply(*args)

    def autograd_kernel(keyset, *args):
        plain = keyset.raw_repr() & after_autograd_bits in _IMPL_KEYSETS
        if torch.is_grad_enabled():
            n = len(args)  # the dispatcher drops trailing arguments left at their defaults
            for i in tensors:
                if i < n and args[i] is not None and args[i].requires_grad:
                    if torch._C._are_functorch_transforms_active():
                        return transformed(*args)
                    if plain:
                        return direct(*args)
                    return redispatched(*args)
        if plain:
            return impl(*args)
        if torch._C._are_functorch_transforms_active():
            _check_transform(name)
        return op.redispatch(keyset & after_autograd, *args)

    _LIB.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    inductor.add(name, _graph_call(op, impl))
    if prechecked is not None:
        # Without defaults, so that a compiled graph passes every argument positionally (by
        # keyword, about 4 us more per call).
        plain = re.sub(r"\s*=\s*(\"[^\"]*\"|[^,)]+)", "", schema)
        _define(name + "_prechecked", plain, prechecked, fake, tensors, setup, backward, why=why)


# ----------------------------------------------------------------------------- sdpa


def _sdpa_forward(q, k, v, attn_mask, *options):
    check.check_sdpa(q, k, v, attn_mask, True, options[3] if len(options) > 3 else None)
    return _sdpa_forward_prechecked(q, k, v, attn_mask, *options)


# run_op options of the common sdpa_forward call (three options: no sinks, the rest at their
# defaults), by (dropout_p, is_causal, scale): a decode stream asks for the same ones per token.
_COMMON_RUN_OPTIONS = {}


def _sdpa_run_options(options, lse=True):
    """Attn(*options).run_options(), kept for the common case (not for a scale of +-0.0, which
    compare equal: plans tell them apart); without lse, with the run option "lse" = 0 (the
    kernels do not store it)."""
    if len(options) != 3 or options[2] == 0.0:
        return Attn(*options).run_options(**({} if lse else {"lse": 0}))
    key = options if lse else (*options, "no lse")
    found = _COMMON_RUN_OPTIONS.get(key)
    if found is None:
        if len(_COMMON_RUN_OPTIONS) >= 256:  # a bound for scales that change every call
            _COMMON_RUN_OPTIONS.clear()
        found = Attn(*options).run_options(**({} if lse else {"lse": 0}))
        _COMMON_RUN_OPTIONS[key] = found
    return found


def _sdpa_forward_prechecked(q, k, v, attn_mask, *options):
    return _sdpa_forward_run(q, k, v, attn_mask, options, True)


def _sdpa_forward_run(q, k, v, attn_mask, options, want_lse):
    """sdpa_forward's (out, lse) once the inputs are checked; with want_lse False, the lse
    returned is not written (the kernels skip it) and must not escape."""
    out, lse = run(
        "sdpa",
        [q, k, v, attn_mask, options[3] if len(options) > 3 else None],
        _sdpa_run_options(options, want_lse),
        lambda: ref.sdpa_forward(q, k, v, attn_mask, *Attn(*options).math()),
    )
    if out.stride() != q.stride() or out.shape[-1] != q.shape[-1]:  # else it has q's layout
        strides = ref.layout_strides(q, out.shape)
        if list(out.stride()) != strides and out.numel() > 1:
            out = ref.like_layout(q, out.shape).copy_(out)  # the op's layout contract (see above)
    return out, lse


def _sdpa_forward_fake(q, k, v, attn_mask, *options):
    check.check_sdpa(q, k, v, attn_mask, True, Attn(*options).sinks)
    lse = q.new_empty(q.shape[:-1], dtype=ref.compute_dtype(q.dtype))
    return ref.like_layout(q, (*q.shape[:-1], v.shape[-1])), lse


def _sdpa_backward(grad_out, grad_lse, q, k, v, out, lse, attn_mask, mask_grad, *options):
    attn = Attn(*options)
    if mask_grad and (attn_mask is None or not attn_mask.is_floating_point()):
        raise ValueError("steel.sdpa_backward: mask_grad needs a float attn_mask")

    def reference():
        dq, dk, dv, dsinks, dmask = ref.sdpa_backward(
            grad_out, grad_lse, q, k, v, lse, attn_mask, *attn.math(), mask_grad=mask_grad
        )
        return [g for g in (dq, dk, dv, dsinks, dmask) if g is not None]

    grads = run(
        "sdpa_backward",
        [grad_out, q, k, v, out, lse, attn_mask, attn.sinks, grad_lse],
        attn.run_options(mask_grad=bool(mask_grad)),
        reference,
    )
    dmask = grads[-1] if mask_grad else q.new_empty(0)
    return grads[0], grads[1], grads[2], _dsinks(grads, attn, q), dmask


def _sdpa_backward_fake(grad_out, grad_lse, q, k, v, out, lse, attn_mask, mask_grad, *options):
    sinks = Attn(*options).sinks
    dmask = attn_mask.new_empty(attn_mask.shape) if mask_grad else q.new_empty(0)
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        _sinks_fake(sinks, q),
        dmask,
    )


_define(
    "sdpa_backward",
    "(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    f"Tensor? attn_mask, bool mask_grad, {_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _sdpa_backward,
    _sdpa_backward_fake,
    (0, 1, 2, 3, 4, 5, 6, 7, 12),  # every tensor: a gradient of the gradients is not served
)


def _attn_and_sinks(options):
    """A forward's options for its backward: (Attn without sinks, which the context keeps;
    sinks, a tensor, which goes through save_for_backward). _replace costs microseconds: only
    when there are sinks."""
    attn = Attn(*options)
    if attn.sinks is None:
        return attn, None
    return attn._replace(sinks=None), attn.sinks


def _sdpa_setup(ctx, inputs, output):
    q, k, v, attn_mask, *options = inputs
    ctx.attn, sinks = _attn_and_sinks(options)
    ctx.backend = current_backend()  # the backward runs where the forward ran
    ctx.save_for_backward(q, k, v, attn_mask, sinks, *output)


def _sdpa_backward_autograd(ctx, grad_out, grad_lse):
    q, k, v, attn_mask, sinks, out, lse = ctx.saved_tensors
    attn = ctx.attn._replace(sinks=sinks)
    if grad_out is None:  # only lse was used
        grad_out = torch.zeros_like(out)
    # The mask's gradient is an L x S tensor: computed only when the mask asks for it.
    mask_grad = bool(ctx.needs_input_grad[3])
    with backend(ctx.backend):
        dq, dk, dv, dsinks, dmask = torch.ops.steel.sdpa_backward(
            grad_out, grad_lse, q, k, v, out, lse, attn_mask, mask_grad, *attn
        )
    grads = dict.fromkeys(Attn._fields)
    grads["sinks"] = dsinks if sinks is not None else None
    return dq, dk, dv, dmask if mask_grad else None, *grads.values()


_define(
    "sdpa_forward",
    f"(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, {_OPTIONS_DEFAULTS}) -> (Tensor, Tensor)",
    _sdpa_forward,
    _sdpa_forward_fake,
    (0, 1, 2, 3, 7),  # q, k, v, attn_mask, sinks
    _sdpa_setup,
    _sdpa_backward_autograd,  # sdpa_backward for the gradients
    _sdpa_forward_prechecked,
)
# The overloads themselves: calling a packet (torch.ops.steel.sdpa_forward) resolves it per call.
_SDPA_FORWARD = torch.ops.steel.sdpa_forward.default
_SDPA_FORWARD_PRECHECKED = torch.ops.steel.sdpa_forward_prechecked.default
# Through the dispatcher by the overload's C++ entry point, without OpOverload.__call__'s frame.
_SDPA_FORWARD_CALLS = (_SDPA_FORWARD._op, _sdpa_forward, _FUNCTIONS["sdpa_forward"])


_ATTN_TAIL = Attn(0.0, False, 1.0)[3:]  # sdpa_forward's defaulted arguments, sinks on


def _call_sdpa_forward(*args):
    """sdpa_forward(*args), or its prechecked twin, which takes every argument, while
    torch.compile traces (see _define). Eagerly what the dispatcher would call when it would
    do nothing else (_undispatched), else the overload's C++ entry point, without
    OpOverload.__call__'s Python frame."""
    if torch.compiler.is_compiling():
        return _SDPA_FORWARD_PRECHECKED(*args, *_ATTN_TAIL[len(args) - 7 :])
    how = _undispatched(*args[:4], args[7] if len(args) > 7 else None)  # q, k, v, mask, sinks
    return _SDPA_FORWARD_CALLS[how](*args)


def _call_sdpa_out(*args):
    """_call_sdpa_forward(*args)'s out, for a caller that drops lse: when the call would go
    straight to the implementation (_undispatched: no gradient recorded, so no backward will
    read lse, and nothing else sees the op), the kernels skip lse's store."""
    if torch.compiler.is_compiling():
        return _call_sdpa_forward(*args)[0]
    q, k, v, attn_mask, *options = args
    sinks = options[3] if len(options) > 3 else None
    if _undispatched(q, k, v, attn_mask, sinks) != _IMPL:
        return _call_sdpa_forward(*args)[0]
    check.check_sdpa(q, k, v, attn_mask, True, sinks)
    return _sdpa_forward_run(q, k, v, attn_mask, tuple(options), False)[0]


def _broadcast_qkv(q, k, v, enable_gqa):
    """Expands query, key, value to one rank (at least 3) and one batch shape.

    F.scaled_dot_product_attention broadcasts the dims before [seq, dim] like matmul, heads
    included unless enable_gqa groups them. Expanding here (views; autograd sums the gradients
    back) keeps the internal ops on [*batch, heads, seq, dim]. With enable_gqa, key and value
    may have different head counts (each dividing the query's), as F.sdpa allows: query head h
    reads key head h // (Hq / Hk) and value head h // (Hq / Hv); the internal ops take one
    head count for both, so the one with fewer heads is repeated (a copy, in this rare case) to
    the other's count, or both to Hq when neither count divides the other. Shapes that do not
    broadcast are returned rank-padded only, for check_sdpa to name the mismatch.
    """
    rank = max(q.dim(), k.dim(), v.dim(), 3)
    q, k, v = (t[(None,) * (rank - t.dim())] for t in (q, k, v))
    if enable_gqa:
        k, v = _match_kv_heads(q.shape[-3], k, v)
    try:
        batch = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        hq, hkv = q.shape[-3], torch.broadcast_shapes(k.shape[-3:-2], v.shape[-3:-2])[0]
        if not enable_gqa:
            hq = hkv = torch.broadcast_shapes((hq,), (hkv,))[0]
    except RuntimeError:
        return q, k, v
    return (
        q.expand(*batch, hq, *q.shape[-2:]),
        k.expand(*batch, hkv, *k.shape[-2:]),
        v.expand(*batch, hkv, *v.shape[-2:]),
    )


def _match_kv_heads(hq, k, v):
    """Grouped-query key and value of different head counts -> one head count (see above)."""
    hk, hv = k.shape[-3], v.shape[-3]
    if hk == hv or min(hk, hv) == 1 or hk == 0 or hv == 0 or hq % hk or hq % hv:
        return k, v  # equal, broadcast (1 head), or invalid: check_sdpa names the problem
    target = max(hk, hv) if max(hk, hv) % min(hk, hv) == 0 else hq
    return k.repeat_interleave(target // hk, -3), v.repeat_interleave(target // hv, -3)


def _plain_qkv(q, k, v, enable_gqa):
    """The common case: tensors of one rank >= 3 and one batch shape, with one head count (key
    and value's dividing the query's, which the op checks, with enable_gqa): nothing to
    broadcast, the op's own checks say everything else."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    n = len(qs)
    return (
        n >= 3
        and len(ks) == n == len(vs)
        # [B, H, L, E] compared without slicing (each slice is a new torch.Size)
        and (qs[0] == ks[0] == vs[0] if n == 4 else qs[:-3] == ks[:-3] == vs[:-3])
        and ks[-3] == vs[-3]
        and (enable_gqa or qs[-3] == ks[-3])
    )


def _sdpa_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks,
                 softcap, window, causal_align, seed, offset):  # fmt: skip
    """Resolves the public sdpa arguments; returns (sdpa_forward's arguments, squeeze), where
    squeeze says that the inputs had rank 2 and the results lose the added leading dim.

    The common case is validated once, by the op; inputs that need broadcasting are checked here
    too, before broadcasting hides what the caller passed (enable_gqa included)."""
    squeeze = False
    if not _plain_qkv(query, key, value, enable_gqa):
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not torch.is_tensor(t) or t.dim() < 2:
                raise ValueError(
                    f"steel.sdpa: {name} must be a tensor of rank >= 2 ([..., seq, dim])"
                )
        squeeze = max(query.dim(), key.dim(), value.dim()) == 2
        query, key, value = _broadcast_qkv(query, key, value, enable_gqa)
        check.check_sdpa(query, key, value, attn_mask, enable_gqa, sinks)
    attn = _resolve("sdpa", query.shape[-1], dropout_p, is_causal, scale, sinks, softcap, window,
                    causal_align, seed, offset)  # fmt: skip
    if attn.sinks is None and attn[4:] == _ATTN_DEFAULTS:
        return (query, key, value, attn_mask, *attn[:3]), squeeze  # fewer arguments to convert
    return (query, key, value, attn_mask, *attn), squeeze


_ATTN_DEFAULTS = Attn(0.0, False, 1.0)[4:]


_LIB.define(
    "sdpa(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float dropout_p=0.0, "
    f"bool is_causal=False, float? scale=None, bool enable_gqa=False, *, {_EXTENSIONS}) -> Tensor"
)


def _sdpa_composite(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False, *, sinks=None, softcap=0.0, window=None,
                    causal_align="top_left", seed=None, offset=0):  # fmt: skip
    inputs, squeeze = _sdpa_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                   enable_gqa, sinks, softcap, window, causal_align, seed,
                                   offset)  # fmt: skip
    out = _call_sdpa_out(*inputs)
    return out.squeeze(0) if squeeze else out


_LIB.impl("sdpa", _sdpa_composite, "CompositeImplicitAutograd")


def _causal_bias(attn_mask, is_causal, causal_align, query, key):
    """A torch.nn.attention.bias.CausalBias mask becomes (None, True, its alignment)."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    if not isinstance(attn_mask, CausalBias):
        if attn_mask is not None and not isinstance(attn_mask, Tensor):
            raise TypeError(
                "steel.sdpa: attn_mask must be a Tensor (or a torch.nn.attention.bias "
                f"CausalBias), got {type(attn_mask).__name__}"
            )
        return attn_mask, is_causal, causal_align
    if is_causal:
        raise ValueError("steel.sdpa: pass either is_causal=True or a CausalBias mask, not both")
    lengths = (query.shape[-2], key.shape[-2])
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != lengths:
        raise ValueError(
            f"steel.sdpa: the CausalBias is for (L, S) = ({attn_mask.seq_len_q}, "
            f"{attn_mask.seq_len_kv}) but query and key give {lengths}"
        )
    align = "bottom_right" if attn_mask.variant == CausalVariant.LOWER_RIGHT else "top_left"
    return None, True, align


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
         enable_gqa=False, *, sinks=None, softcap=None, window=None, causal_align="top_left",
         seed=None, offset=0, return_lse=False):  # fmt: skip
    """torch.nn.functional.scaled_dot_product_attention, plus keyword-only extensions.

    Same arguments and results as F.scaled_dot_product_attention ([*batch, heads, L, E] query,
    [*batch, heads_kv, S, E] key, [*batch, heads_kv, S, Ev] value; leading dims broadcast, heads
    too unless enable_gqa; bool masks keep where True, float masks are added; rows that see no
    key are zero; is_causal together with a mask applies both, as PyTorch does; a float mask
    is differentiable), and:
      attn_mask:    may also be torch.nn.attention.bias.causal_lower_right(L, S) or
                    causal_upper_left(L, S) (causal with that alignment).
      sinks:        [heads] tensor; an extra logit per head in every softmax row, with no value
                    (gpt-oss style attention sinks). Differentiable.
      softcap:      logits become softcap * tanh(logits / softcap) before the mask (Gemma 2).
      window:       (left, right): row i sees keys i - left .. i + right (on the aligned
                    diagonal); -1 leaves a side unbounded. window=(w, 0) is causal sliding window.
      causal_align: "top_left" (PyTorch's is_causal) or "bottom_right" (the last query row sees
                    the last key: the decode / chunked prefill convention). Applies to the window.
      seed, offset: dropout RNG key (see torch_steel.dropout); seed defaults to a draw from
                    torch's default generator, so torch.manual_seed makes runs repeatable.
      return_lse:   also return the log-sum-exp of each row, float32 [*batch, heads, L]
                    (float64 for float64 inputs); differentiable.
    """
    if (
        (attn_mask is None or type(attn_mask) is Tensor)  # CausalBias is a subclass
        and dropout_p == 0.0
        and sinks is None
        and not softcap
        and window is None
        and causal_align == "top_left"
        and seed is None
        and offset == 0
        and _plain_qkv(query, key, value, enable_gqa)
    ):
        # The common case, decided in these few checks: the op validates the rest, and there
        # is nothing to resolve but the scale.
        if scale is None:
            e = query.shape[-1]
            scale = 1.0 / math.sqrt(e) if e > 0 else 1.0
        args = (query, key, value, attn_mask, 0.0, bool(is_causal), float(scale))
        return _call_sdpa_forward(*args) if return_lse else _call_sdpa_out(*args)
    if type(key) is QuantizedKV or type(value) is QuantizedKV:
        return _sdpa_quantized(query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa, sinks, softcap, window, causal_align, seed, offset,
                               return_lse)  # fmt: skip
    if attn_mask is not None and type(attn_mask) is not Tensor:
        attn_mask, is_causal, causal_align = _causal_bias(
            attn_mask, is_causal, causal_align, query, key
        )
    inputs, squeeze = _sdpa_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                   enable_gqa, sinks, softcap, window, causal_align, seed,
                                   offset)  # fmt: skip
    if return_lse:
        out, lse = _call_sdpa_forward(*inputs)
        return (out.squeeze(0), lse.squeeze(0)) if squeeze else (out, lse)
    out = _call_sdpa_out(*inputs)
    return out.squeeze(0) if squeeze else out


# ----------------------------------------------------------------------------- sdpa_varlen


def _sdpa_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         *options):  # fmt: skip
    check.check_varlen(q, k, v, Attn(*options).sinks, op="sdpa_varlen_forward")
    return _sdpa_varlen_forward_run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, *options)  # fmt: skip


def _sdpa_varlen_forward_run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             *options):  # fmt: skip
    """sdpa_varlen_forward once query, key and value are checked (by it, or by sdpa_varlen)."""
    attn = Attn(*options)
    check.check_cu_seqlens("sdpa_varlen", cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                           max_seqlen_q, max_seqlen_k, q.device)  # fmt: skip
    out, lse = run(
        "sdpa_varlen",
        [q, k, v, cu_seqlens_q, cu_seqlens_k, attn.sinks],
        attn.run_options(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k),
        lambda: ref.sdpa_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *attn.math()),
    )
    return out, lse


def _varlen_outputs_fake(q, v):
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=ref.compute_dtype(q.dtype))
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1])), lse


def _sdpa_varlen_forward_fake(q, k, v, *rest):
    return _varlen_outputs_fake(q, v)


def _sdpa_varlen_backward(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, *options):  # fmt: skip
    attn = Attn(*options)

    def reference():
        dq, dk, dv, dsinks = ref.sdpa_varlen_backward(
            grad_out, grad_lse, q, k, v, lse, cu_seqlens_q, cu_seqlens_k, *attn.math()
        )
        return [dq, dk, dv] + ([dsinks] if dsinks is not None else [])

    grads = run(
        "sdpa_varlen_backward",
        [grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, attn.sinks, grad_lse],
        attn.run_options(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k),
        reference,
    )
    return grads[0], grads[1], grads[2], _dsinks(grads, attn, q)


def _sdpa_varlen_backward_fake(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                               *options):  # fmt: skip
    sinks = Attn(*options).sinks
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _sinks_fake(sinks, q)


_define(
    "sdpa_varlen_backward",
    "(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    f"{_VARLEN}, {_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor)",
    _sdpa_varlen_backward,
    _sdpa_varlen_backward_fake,
    (0, 1, 2, 3, 4, 5, 6, 14),  # the float tensors: a gradient of the gradients is not served
)


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, *options = inputs
    ctx.lengths = (max_q, max_k)
    ctx.attn, sinks = _attn_and_sinks(options)
    ctx.backend = current_backend()
    ctx.save_for_backward(q, k, v, cu_q, cu_k, sinks, *output)


def _varlen_backward_autograd(ctx, grad_out, grad_lse):
    q, k, v, cu_q, cu_k, sinks, out, lse = ctx.saved_tensors
    attn = ctx.attn._replace(sinks=sinks)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    with backend(ctx.backend):
        dq, dk, dv, dsinks = torch.ops.steel.sdpa_varlen_backward(
            grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, *ctx.lengths, *attn
        )
    grads = dict.fromkeys(Attn._fields)
    grads["sinks"] = dsinks if sinks is not None else None
    return dq, dk, dv, None, None, None, None, *grads.values()


_define(
    "sdpa_varlen_forward",
    f"(Tensor q, Tensor k, Tensor v, {_VARLEN}, {_OPTIONS}) -> (Tensor, Tensor)",
    _sdpa_varlen_forward,
    _sdpa_varlen_forward_fake,
    (0, 1, 2, 10),  # q, k, v, sinks
    _varlen_setup,
    _varlen_backward_autograd,  # sdpa_varlen_backward for the gradients
)


_SDPA_VARLEN_FORWARD = torch.ops.steel.sdpa_varlen_forward.default
# The implementation without the checks of query, key and value: sdpa_varlen made them.
_SDPA_VARLEN_FORWARD_CALLS = (
    _SDPA_VARLEN_FORWARD,
    _sdpa_varlen_forward_run,
    _FUNCTIONS["sdpa_varlen_forward"],
)


def _varlen_inputs(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, is_causal, scale, sinks, softcap, window, causal_align, seed,
                   offset):  # fmt: skip
    check.check_varlen(query, key, value, sinks)
    attn = _resolve("sdpa_varlen", query.shape[-1], dropout_p, is_causal, scale, sinks, softcap,
                    window, causal_align, seed, offset)  # fmt: skip
    return (query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *attn)


_LIB.define(
    f"sdpa_varlen(Tensor query, Tensor key, Tensor value, {_VARLEN}, float dropout_p=0.0, "
    f"bool is_causal=False, float? scale=None, *, {_EXTENSIONS}) -> Tensor"
)


def _varlen_composite(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      dropout_p=0.0, is_causal=False, scale=None, *, sinks=None, softcap=0.0,
                      window=None, causal_align="top_left", seed=None, offset=0):  # fmt: skip
    inputs = _varlen_inputs(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, dropout_p, is_causal, scale, sinks, softcap, window,
                            causal_align, seed, offset)  # fmt: skip
    return torch.ops.steel.sdpa_varlen_forward(*inputs)[0]


_LIB.impl("sdpa_varlen", _varlen_composite, "CompositeImplicitAutograd")


def _sdpa_paged_forward(q, k, v, cu_seqlens_q, block_table, seqused_k, max_seqlen_q,
                        max_seqlen_k, *options):  # fmt: skip
    attn = Attn(*options)
    check.check_paged("sdpa_varlen", q, k, v, attn.sinks, cu_seqlens_q, block_table, seqused_k,
                      max_seqlen_q, max_seqlen_k)  # fmt: skip
    out, lse = run(
        "sdpa_varlen",
        [q, k, v, cu_seqlens_q, None, attn.sinks, block_table, seqused_k],
        attn.run_options(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k),
        lambda: ref.sdpa_paged_forward(q, k, v, cu_seqlens_q, block_table, seqused_k, *attn.math()),
    )
    return out, lse


def _sdpa_paged_forward_fake(q, k, v, *rest):
    return _varlen_outputs_fake(q, v)


_define(
    "sdpa_paged_forward",
    "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor block_table, Tensor seqused_k, "
    f"int max_seqlen_q, int max_seqlen_k, {_OPTIONS}) -> (Tensor, Tensor)",
    _sdpa_paged_forward,
    _sdpa_paged_forward_fake,
    (0, 1, 2, 11),  # q, k, v, sinks: inference only (a KV cache has no gradient)
)


def sdpa_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                dropout_p=0.0, is_causal=False, scale=None, *, sinks=None, softcap=None,
                window=None, causal_align="top_left", seed=None, offset=0, return_lse=False,
                block_table=None, seqused_k=None, num_splits=None):  # fmt: skip
    """Attention over packed variable-length sequences (flash-attn's varlen convention).

    query [total_q, heads, E], key [total_k, heads_kv, E], value [total_k, heads_kv, Ev];
    sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of query and
    cu_seqlens_k[b]:cu_seqlens_k[b+1] of key/value (int32 offsets starting at 0); max_seqlen_*
    bound the lengths. heads must be a multiple of heads_kv (grouped-query attention is implied).
    Options as in torch_steel.sdpa; is_causal and window align per sequence (causal_align
    defaults to "top_left" like sdpa; flash-attn's causal is "bottom_right"). Dropout treats the
    sequence index as the batch index. lse is [heads, total_q].

    A paged KV cache (PyTorch's varlen_attn convention): key and value are pools
    [pages, page_size, heads_kv, E|Ev], block_table int32 [batch, max_pages] lists each
    sequence's pages in order, seqused_k int32 [batch] its keys (the last page partly filled),
    and cu_seqlens_k is None. Key j of sequence b is slot j % page_size of page
    block_table[b, j // page_size]. Inference only (no autograd); served by the decode kernels
    (blocks of 32 query rows beyond 8 rows per sequence).
    num_splits: how many partitions the decode kernels split each sequence's keys into
    (None lets the plan choose from the shapes; 1 computes each sequence in one pass, so its
    result is bitwise the same whatever else is in the batch).
    """
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 0):
        check.fail("sdpa_varlen", f"num_splits must be an int >= 0 (0: the plan's choice), "
                   f"got {num_splits!r}")  # fmt: skip
    splits = 0 if num_splits is None else num_splits
    if type(key) is QuantizedKV or type(value) is QuantizedKV:
        return _varlen_quantized(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, dropout_p, is_causal, scale, sinks, softcap,
                                 window, causal_align, seed, offset, return_lse, block_table,
                                 seqused_k, splits)  # fmt: skip
    if block_table is not None or seqused_k is not None:
        if block_table is None or seqused_k is None or cu_seqlens_k is not None:
            check.fail("sdpa_varlen", "a paged KV cache takes block_table and seqused_k, and "
                       "cu_seqlens_k=None")  # fmt: skip
        check.check_paged("sdpa_varlen", query, key, value, sinks, cu_seqlens_q, block_table,
                          seqused_k, max_seqlen_q, max_seqlen_k)  # fmt: skip
        attn = _resolve("sdpa_varlen", query.shape[-1], dropout_p, is_causal, scale, sinks,
                        softcap, window, causal_align, seed, offset)  # fmt: skip
        attn = attn._replace(num_splits=splits)
        cache = (cu_seqlens_q, block_table, seqused_k, max_seqlen_q, max_seqlen_k)
        out, lse = torch.ops.steel.sdpa_paged_forward(query, key, value, *cache, *attn)
        return (out, lse) if return_lse else out
    inputs = _varlen_inputs(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, dropout_p, is_causal, scale, sinks, softcap, window,
                            causal_align, seed, offset)  # fmt: skip
    inputs = (*inputs[:-1], splits)  # num_splits is the last option
    # q, k, v, cu_seqlens, sinks: see gemm
    how = 0 if torch.compiler.is_compiling() else _undispatched(*inputs[:5], inputs[10])
    out, lse = _SDPA_VARLEN_FORWARD_CALLS[how](*inputs)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- quantized KV
#
# torch_steel.sdpa and sdpa_varlen take a QuantizedKV (torch_steel.kv) as key and value. The ops
# take its tensors and format string: data, scales, mins (None for int8) and the format, of the
# key and then of the value, in place of k and v.

_QKV = (
    "Tensor k, Tensor k_scales, Tensor? k_mins, Tensor v, Tensor v_scales, Tensor? v_mins, "
    "str k_format, str v_format"
)
_QKV_INFERENCE = (
    "quantized K/V are inference only: K and V are dequantized as they are loaded and the "
    "integer codes have no gradient"
)


def _quantized(op, q, k, k_scales, k_mins, v, v_scales, v_mins, k_format, v_format):
    """The op's key and value as QuantizedKV (validated, naming op), and stand-ins of their
    logical shapes in q's dtype (one element, zero strides) for the shape checks."""
    pair = []
    for name, parts in (("key", (k, k_scales, k_mins, k_format)),
                        ("value", (v, v_scales, v_mins, v_format))):  # fmt: skip
        x = QuantizedKV.__new__(QuantizedKV)
        x.data, x.scales, x.mins, x.format = parts
        qkv.validate(x, f"steel.{op}: {name}")
        if x.device != q.device:
            check.fail(op, f"{name} is on {x.device} but query on {q.device}")
        pair.append(x)
    stand_ins = [q.new_empty(()).expand(x.shape) for x in pair]
    return pair, stand_ins


def _dequantized(q, pair):
    return [x.dequantize(q.dtype) for x in pair]


def _sdpa_quantized_forward(q, k, k_scales, k_mins, v, v_scales, v_mins, k_format, v_format,
                            attn_mask, *options):  # fmt: skip
    attn = Attn(*options)
    pair, (ks, vs) = _quantized("sdpa", q, k, k_scales, k_mins, v, v_scales, v_mins, k_format,
                                v_format)  # fmt: skip
    check.check_sdpa(q, ks, vs, attn_mask, True, attn.sinks)
    out, lse = run(
        "sdpa_quantized",
        [q, k, k_scales, k_mins, v, v_scales, v_mins, attn_mask, attn.sinks],
        attn.run_options(k_format=k_format, v_format=v_format),
        lambda: ref.sdpa_forward(q, *_dequantized(q, pair), attn_mask, *attn.math()),
    )
    return out, lse


def _sdpa_quantized_forward_fake(q, k, k_scales, k_mins, v, v_scales, v_mins, k_format, v_format,
                                 attn_mask, *options):  # fmt: skip
    _, (ks, vs) = _quantized("sdpa", q, k, k_scales, k_mins, v, v_scales, v_mins, k_format,
                             v_format)  # fmt: skip
    return _sdpa_forward_fake(q, ks, vs, attn_mask, *options)


_define(
    "sdpa_quantized_forward",
    f"(Tensor q, {_QKV}, Tensor? attn_mask, {_OPTIONS_DEFAULTS}) -> (Tensor, Tensor)",
    _sdpa_quantized_forward,
    _sdpa_quantized_forward_fake,
    (0, 2, 3, 5, 6, 9, 13),  # q, the scales and mins, attn_mask, sinks: inference only
    why=_QKV_INFERENCE,
)


def _refuse_gradient(op, *tensors):
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            f"steel.{op}: {_QKV_INFERENCE}; call it under torch.no_grad() (or on tensors that "
            "do not require grad)"
        )


def _quantized_pair(op, key, value):
    if not (isinstance(key, QuantizedKV) and isinstance(value, QuantizedKV)):
        raise TypeError(
            f"steel.{op}: key and value must both be QuantizedKV or both be tensors, got "
            f"{type(key).__name__} and {type(value).__name__}"
        )
    return (*key.tensors(), *value.tensors(), key.format, value.format)


def _sdpa_quantized(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks,
                    softcap, window, causal_align, seed, offset, return_lse):  # fmt: skip
    """torch_steel.sdpa with QuantizedKV key and value: no broadcasting (one rank, one batch
    shape), key and value of one head count."""
    tensors = _quantized_pair("sdpa", key, value)
    if not torch.is_tensor(query):
        raise TypeError(f"steel.sdpa: query must be a Tensor, got {type(query).__name__}")
    _refuse_gradient("sdpa", query, attn_mask, sinks, *tensors[:6])
    if attn_mask is not None and type(attn_mask) is not Tensor:
        attn_mask, is_causal, causal_align = _causal_bias(
            attn_mask, is_causal, causal_align, query, key
        )
    if not query.dim() == key.dim() == value.dim():
        ranks = f"{query.dim()}, {key.dim()}, {value.dim()}"
        check.fail("sdpa", "a quantized key and value take no broadcasting: query, key and "
                   f"value must have one rank, got {ranks}")  # fmt: skip
    if key.dim() >= 3 and key.shape[-3] != value.shape[-3]:
        check.fail("sdpa", f"a quantized key and value must have one head count, got "
                   f"{key.shape[-3]} and {value.shape[-3]}")  # fmt: skip
    stand_ins = [query.new_empty(()).expand(x.shape) for x in (key, value)]
    check.check_sdpa(query, *stand_ins, attn_mask, enable_gqa, sinks)
    attn = _resolve("sdpa", query.shape[-1], dropout_p, is_causal, scale, sinks, softcap, window,
                    causal_align, seed, offset)  # fmt: skip
    out, lse = torch.ops.steel.sdpa_quantized_forward(query, *tensors, attn_mask, *attn)
    return (out, lse) if return_lse else out


def _sdpa_varlen_quantized_forward(q, k, k_scales, k_mins, v, v_scales, v_mins, k_format,
                                   v_format, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                                   max_seqlen_q, max_seqlen_k, *options):  # fmt: skip
    attn = Attn(*options)
    op = "sdpa_varlen"
    pair, (ks, vs) = _quantized(op, q, k, k_scales, k_mins, v, v_scales, v_mins, k_format,
                                v_format)  # fmt: skip
    paged = block_table is not None
    if paged:
        check.check_paged(op, q, ks, vs, attn.sinks, cu_seqlens_q, block_table, seqused_k,
                          max_seqlen_q, max_seqlen_k)  # fmt: skip
        cache = (block_table, seqused_k)
    else:
        check.check_varlen(q, ks, vs, attn.sinks)
        check.check_cu_seqlens(op, cu_seqlens_q, cu_seqlens_k, q.shape[0], ks.shape[0],
                               max_seqlen_q, max_seqlen_k, q.device)  # fmt: skip
        cache = (cu_seqlens_k,)

    def reference():
        kd, vd = _dequantized(q, pair)
        if paged:
            return ref.sdpa_paged_forward(q, kd, vd, cu_seqlens_q, *cache, *attn.math())
        return ref.sdpa_varlen_forward(q, kd, vd, cu_seqlens_q, *cache, *attn.math())

    out, lse = run(
        "sdpa_varlen_quantized",
        [q, k, k_scales, k_mins, v, v_scales, v_mins, cu_seqlens_q, cu_seqlens_k, attn.sinks,
         block_table, seqused_k],
        attn.run_options(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         k_format=k_format, v_format=v_format),
        reference,
    )  # fmt: skip
    return out, lse


def _sdpa_varlen_quantized_forward_fake(q, k, k_scales, k_mins, v, v_scales, v_mins, k_format,
                                        v_format, *rest):  # fmt: skip
    _, (_, vs) = _quantized("sdpa_varlen", q, k, k_scales, k_mins, v, v_scales, v_mins, k_format,
                            v_format)  # fmt: skip
    return _varlen_outputs_fake(q, vs)


_define(
    "sdpa_varlen_quantized_forward",
    f"(Tensor q, {_QKV}, Tensor cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? block_table, "
    f"Tensor? seqused_k, int max_seqlen_q, int max_seqlen_k, {_OPTIONS}) -> (Tensor, Tensor)",
    _sdpa_varlen_quantized_forward,
    _sdpa_varlen_quantized_forward_fake,
    (0, 2, 3, 5, 6, 18),  # q, the scales and mins, sinks: inference only
    why=_QKV_INFERENCE,
)


def _varlen_quantized(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      dropout_p, is_causal, scale, sinks, softcap, window, causal_align, seed,
                      offset, return_lse, block_table, seqused_k, splits):  # fmt: skip
    """sdpa_varlen with QuantizedKV key and value: packed [total_k, H, E] or paged pools."""
    tensors = _quantized_pair("sdpa_varlen", key, value)
    _refuse_gradient("sdpa_varlen", query, sinks, *tensors[:6])
    if (block_table is None) != (seqused_k is None) or (
        block_table is not None and cu_seqlens_k is not None
    ):
        check.fail("sdpa_varlen", "a paged KV cache takes block_table and seqused_k, and "
                   "cu_seqlens_k=None")  # fmt: skip
    attn = _resolve("sdpa_varlen", query.shape[-1], dropout_p, is_causal, scale, sinks, softcap,
                    window, causal_align, seed, offset)._replace(num_splits=splits)  # fmt: skip
    out, lse = torch.ops.steel.sdpa_varlen_quantized_forward(
        query, *tensors, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, max_seqlen_q,
        max_seqlen_k, *attn
    )  # fmt: skip
    return (out, lse) if return_lse else out


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
_GEMM_CALLS = (_GEMM._op, _gemm, _FUNCTIONS["gemm"])  # as _SDPA_FORWARD_CALLS


def gemm(a, b, *, bias=None, c=None, alpha=1.0, beta=0.0, activation="none"):
    """act(alpha * (a @ b) + beta * c + bias); a [..., M, K], b [..., K, N], bias [N].

    Batch dims broadcast like torch.matmul; c broadcasts to the output and is ignored when
    beta == 0 (like addmm); activation is none, relu, gelu, gelu_tanh or silu; fp32 accumulation
    for float16/bfloat16. Same as torch.ops.steel.gemm(a, b, bias, c, alpha, beta, activation).
    """
    if torch.compiler.is_compiling():  # see _define
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


# ----------------------------------------------------------------------------- autocast

# Under torch.autocast these ops run in the autocast dtype, as F.scaled_dot_product_attention
# and torch.matmul do: their floating-point tensor arguments (sinks excepted: a per-head logit
# that the kernels read in float32 anyway) are cast to torch.get_autocast_dtype(device) and the
# op runs with autocast off. This is torch.library.register_autocast's mechanism (a kernel at the
# Autocast<Device> key, and the same rule as a py_impl for the Python dispatcher that
# torch.compile traces with), with the dtype read when the op runs instead of fixed when it is
# registered: register_autocast would cast to one dtype whatever the user's autocast asked for.
_AUTOCAST = {  # op -> indices of the tensor arguments to cast
    "sdpa_forward": (0, 1, 2, 3),
    "sdpa_forward_prechecked": (0, 1, 2, 3),
    "sdpa_varlen_forward": (0, 1, 2),
    "gemm": (0, 1, 2, 3),
    "gemm_prechecked": (0, 1, 2, 3),
}


def _autocast_kernel(op, device_type, positions):
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))

    def cast_and_run(*args, **kwargs):
        dtype = torch.get_autocast_dtype(device_type)
        args = list(args)
        for i in positions:
            t = args[i] if i < len(args) else None
            if torch.is_tensor(t) and t.is_floating_point() and t.device.type == device_type:
                args[i] = t.to(dtype)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(*args, **kwargs)

    return key, cast_and_run


def _register_autocast():
    for name, positions in _AUTOCAST.items():
        op = getattr(torch.ops.steel, name).default
        for device_type in ("cpu", "mps"):
            if not torch._C._is_autocast_available(device_type):
                continue
            key, kernel = _autocast_kernel(op, device_type, positions)
            op.py_impl(key)(kernel)
            _LIB.impl(name, lambda _keyset, *a, _k=kernel, **kw: _k(*a, **kw), key.name,
                      with_keyset=True)  # fmt: skip


_register_autocast()
