"""Dense attention: torch.ops.steel.{sdpa, sdpa_forward, sdpa_backward,
sdpa_quantized_forward} and torch_steel.sdpa (see torch_steel.ops for the ops' contract), with
the attention options every attention op takes (Attn) and the quantized K/V pieces that
varlen_ops shares.
"""

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .. import kv as qkv
from .. import reference as ref
from .. import validation as check
from ..backends import backend, current_backend, run
from ..kv import QuantizedKV
from . import nested_ops
from .registry import _FUNCTIONS, _IMPL, _LIB, _define, _undispatched

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
            out = ref.like_layout(q, out.shape).copy_(out)  # torch_steel.ops' layout contract
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
    torch.compile traces (see registry._define). Eagerly what the dispatcher would call when it
    would do nothing else (_undispatched), else the overload's C++ entry point, without
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
    try:
        qs, ks, vs = q.shape, k.shape, v.shape
    except RuntimeError:  # a nested tensor of layout torch.strided has no shape: see _sdpa_inputs
        return False
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
            if t.is_nested:  # torch.strided (sdpa gives jagged ones to nested_ops): refused
                nested_ops.check_layout(name, t)
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
    Jagged nested tensors (torch.nested, layout=torch.jagged) [B, H, j, E] as query, key and
    value are served by the varlen kernels and give a jagged result (see nested_ops).
    """
    if not (type(query) is Tensor and type(key) is Tensor and type(value) is Tensor):
        if nested_ops.is_nested(query, key, value):  # else a Parameter, QuantizedKV, ...
            return nested_ops.sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                   enable_gqa, sinks, softcap, window, causal_align, seed,
                                   offset, return_lse)  # fmt: skip
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
