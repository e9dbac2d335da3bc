"""The machinery that defines the steel ops (torch_steel.ops): `_define` (an op, its fake
implementation, its Autograd kernel and its torch.compile twin), the dispatcher gate
`_undispatched` (when the public functions may skip the dispatcher's pass), the call a compiled
graph makes of each op (`_graph_call`, see torch_steel.inductor) and the autocast kernels.

The op families (attention_ops, varlen_ops, gemm_ops) define their ops with it.
"""

import operator
import re

import torch
from torch import Tensor
from torch._functorch.utils import enable_single_level_autograd_function
from torch.autograd.forward_ad import _set_fwd_grad_enabled
from torch.nn import Parameter

from .. import inductor

_LIB = torch.library.Library("steel", "FRAGMENT")  # holds every steel op (the families define them)


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
