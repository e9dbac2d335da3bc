"""The steel ops: torch.ops.steel.{sdpa, sdpa_varlen, gemm} and their internal pieces.

Public ops (also wrapped as torch_steel.sdpa / sdpa_varlen / gemm / linear):
  steel::sdpa         F.scaled_dot_product_attention plus keyword-only extensions (composite:
                      validates, draws a dropout seed, calls sdpa_forward).
  steel::sdpa_varlen  packed variable-length attention (composite over sdpa_varlen_forward).
  steel::gemm         act(alpha * (a @ b) + beta * c + bias): gemm(a, b, bias=None, c=None,
                      alpha=1.0, beta=0.0, activation="none") (torch.library's custom_op
                      cannot take keyword-only tensors; torch_steel.gemm is keyword-only).
Internal ops (what a Metal kernel implements; autograd connects them):
  steel::sdpa_forward(...) -> (out, lse)       steel::sdpa_backward(...) -> (dq, dk, dv, dsinks)
  steel::sdpa_varlen_forward / steel::sdpa_varlen_backward, the same over packed tensors.

Every op routes through torch_steel.backends.run with these run_op names and arguments
(options is a dict; seeds are split in 32-bit halves because option numbers are doubles):
  "sdpa"                  tensors [q, k, v, attn_mask, sinks] -> [out, lse]
  "sdpa_backward"         tensors [grad_out, q, k, v, out, lse, attn_mask, sinks, grad_lse]
                          -> [dq, dk, dv] (+ [dsinks] when sinks is given)
  "sdpa_varlen"           tensors [q, k, v, cu_seqlens_q, cu_seqlens_k, sinks] -> [out, lse]
  "sdpa_varlen_backward"  tensors [grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks,
                          grad_lse] -> [dq, dk, dv] (+ [dsinks])
  Outputs are contiguous (the fake implementations say so; a kernel must return them so).
  attention options: dropout_p, is_causal, scale (resolved, never None), softcap (0 = off),
  window_left, window_right (-1 = unbounded), bottom_right (bool: causal/window alignment),
  seed_lo, seed_hi, offset (dropout, see torch_steel.dropout); varlen adds max_seqlen_q,
  max_seqlen_k. Absent tensors are None; lse is float32 [*batch, Hq, L] ([Hq, Tq] for varlen).
  "gemm"                  tensors [a, b, bias, c] -> [out]; options alpha, beta, activation.
"""

import math

import torch

from . import reference as ref
from .backends import backend, current_backend, run

_LIB = torch.library.Library("steel", "FRAGMENT")  # holds the composite ops defined below
_ALIGNS = ("top_left", "bottom_right")


# ----------------------------------------------------------------------------- validation


def _fail(op, message):
    raise ValueError(f"steel.{op}: {message}")


def _dtypes(*tensors):
    return ", ".join(str(t.dtype).replace("torch.", "") for t in tensors)


def _check_float_same(op, names, tensors):
    for name, t in zip(names, tensors, strict=False):
        if not torch.is_tensor(t):
            raise TypeError(f"steel.{op}: {name} must be a Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            _fail(op, f"{name} must be a floating-point tensor, got {_dtypes(t)}")
    if len({t.dtype for t in tensors}) != 1:
        _fail(op, f"{', '.join(names)} must share one dtype, got {_dtypes(*tensors)}")
    if len({t.device for t in tensors}) != 1:
        devices = ", ".join(str(t.device) for t in tensors)
        _fail(op, f"{', '.join(names)} must be on one device, got {devices}")


def _check_same_device(op, name, t, like):
    if t.device != like.device:
        _fail(op, f"{name} is on {t.device} but query is on {like.device}")


def _attention_options(op, dropout_p, softcap, window, causal_align, seed, offset):
    """Validated (softcap, window_left, window_right, bottom_right)."""
    if not 0.0 <= dropout_p <= 1.0:
        _fail(op, f"dropout_p must be in [0, 1], got {dropout_p}")
    if softcap is None:
        softcap = 0.0
    if not (softcap >= 0.0 and math.isfinite(softcap)):
        _fail(op, f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    if window is None:
        window = (-1, -1)
    window = tuple(window)
    if len(window) != 2 or any(not isinstance(w, int) or w < -1 for w in window):
        _fail(op, f"window must be (left, right) with ints >= 0, or -1 for unbounded, got {window}")
    if causal_align not in _ALIGNS:
        _fail(op, f"causal_align must be one of {_ALIGNS}, got {causal_align!r}")
    if seed is not None and not 0 <= seed < 2**64:
        _fail(op, f"seed must be in [0, 2**64), got {seed}")
    if not 0 <= offset < 2**32:
        _fail(op, f"offset must be in [0, 2**32), got {offset}")
    return float(softcap), window[0], window[1], causal_align == "bottom_right"


def _check_sinks(op, sinks, heads, query):
    if sinks is None:
        return
    if not torch.is_tensor(sinks) or not sinks.is_floating_point():
        _fail(op, "sinks must be a floating-point tensor of shape [query heads]")
    _check_same_device(op, "sinks", sinks, query)
    if tuple(sinks.shape) != (heads,):
        _fail(
            op,
            f"sinks must have shape [{heads}] (one logit per query head), got {list(sinks.shape)}",
        )


def check_sdpa(q, k, v, attn_mask, enable_gqa, sinks, op="sdpa"):
    """Validates dense attention inputs (rank >= 3: [*batch, heads, seq, dim])."""
    _check_float_same(op, ("query", "key", "value"), (q, k, v))
    if not q.dim() == k.dim() == v.dim():
        _fail(
            op, f"query, key and value must have the same rank, got {q.dim()}, {k.dim()}, {v.dim()}"
        )
    if q.dim() < 3:
        _fail(op, f"expected [*batch, heads, seq, dim] tensors, got rank {q.dim()}")
    if q.shape[-1] != k.shape[-1]:
        _fail(op, f"query and key head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    if k.shape[:-1] != v.shape[:-1]:
        _fail(
            op, f"key {list(k.shape)} and value {list(v.shape)} must agree in all but the last dim"
        )
    if q.shape[:-3] != k.shape[:-3]:
        _fail(op, f"batch dims of query {list(q.shape[:-3])} and key {list(k.shape[:-3])} differ")
    hq, hk = q.shape[-3], k.shape[-3]
    if hq != hk:
        if not enable_gqa:
            _fail(
                op,
                f"query has {hq} heads but key/value have {hk}; pass enable_gqa=True for "
                "grouped-query attention",
            )
        if hk == 0 or hq % hk != 0:
            _fail(
                op,
                f"grouped-query attention needs query heads ({hq}) divisible by key/value "
                f"heads ({hk})",
            )
    if attn_mask is not None:
        if not torch.is_tensor(attn_mask):
            raise TypeError(
                f"steel.{op}: attn_mask must be a Tensor (or a torch.nn.attention.bias"
                f" CausalBias via torch_steel.sdpa), got {type(attn_mask).__name__}"
            )
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            _fail(
                op,
                f"attn_mask must be bool (True = attend) or floating (added), got "
                f"{_dtypes(attn_mask)}",
            )
        _check_same_device(op, "attn_mask", attn_mask, q)
        target = (*q.shape[:-1], k.shape[-2])
        try:
            ok = torch.broadcast_shapes(attn_mask.shape, target) == torch.Size(target)
        except RuntimeError:
            ok = False
        if not ok:
            _fail(
                op,
                f"attn_mask of shape {list(attn_mask.shape)} does not broadcast to the "
                f"attention shape {list(target)}",
            )
    _check_sinks(op, sinks, hq, q)


def check_cu_seqlens(op, cu_q, cu_k, total_q, total_k, max_q, max_k, device):
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not torch.is_tensor(cu) or cu.dtype != torch.int32 or cu.dim() != 1:
            got = f"{_dtypes(cu)} of rank {cu.dim()}" if torch.is_tensor(cu) else type(cu).__name__
            _fail(op, f"{name} must be a 1-D int32 tensor of batch + 1 offsets, got {got}")
        if cu.device != device:
            _fail(op, f"{name} is on {cu.device} but query is on {device}")
        if cu.numel() < 1:
            _fail(op, f"{name} must hold at least one offset")
    if cu_q.numel() != cu_k.numel():
        _fail(
            op,
            f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
            f"{cu_q.numel()} and {cu_k.numel()}",
        )
    for name, cu, total, longest in (
        ("cu_seqlens_q", cu_q, total_q, max_q),
        ("cu_seqlens_k", cu_k, total_k, max_k),
    ):
        values = cu.tolist()
        if values[0] != 0 or values[-1] != total:
            _fail(
                op,
                f"{name} must start at 0 and end at the token count {total}, got "
                f"{values[0]}..{values[-1]}",
            )
        lengths = [b - a for a, b in zip(values, values[1:], strict=False)]
        if any(n < 0 for n in lengths):
            _fail(op, f"{name} must be non-decreasing, got {values}")
        if lengths and max(lengths) > longest:
            _fail(op, f"{name} has a sequence of length {max(lengths)} > max_seqlen {longest}")


def check_varlen(q, k, v, sinks):
    op = "sdpa_varlen"
    _check_float_same(op, ("query", "key", "value"), (q, k, v))
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != 3:
            _fail(op, f"{name} must be packed [total_tokens, heads, dim], got rank {t.dim()}")
    if q.shape[-1] != k.shape[-1]:
        _fail(op, f"query and key head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    if k.shape[:-1] != v.shape[:-1]:
        _fail(
            op, f"key {list(k.shape)} and value {list(v.shape)} must agree in all but the last dim"
        )
    hq, hk = q.shape[1], k.shape[1]
    if hk == 0 or hq % hk != 0:
        _fail(op, f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    _check_sinks(op, sinks, hq, q)


def _seed_options(seed):
    return {"seed_lo": seed & 0xFFFFFFFF, "seed_hi": seed >> 32}


def _resolve_seed(dropout_p, seed):
    """The dropout seed: the caller's, else one drawn from torch's default generator."""
    if dropout_p == 0.0:
        return 0
    if seed is None:
        return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
    return seed


# ----------------------------------------------------------------------------- sdpa


def _attn_options(
    dropout_p, is_causal, scale, softcap, window_left, window_right, bottom_right, seed, offset
):
    return {
        "dropout_p": dropout_p,
        "is_causal": is_causal,
        "scale": scale,
        "softcap": softcap,
        "window_left": window_left,
        "window_right": window_right,
        "bottom_right": bottom_right,
        "offset": offset,
        **_seed_options(seed),
    }


@torch.library.custom_op("steel::sdpa_forward", mutates_args=())
def sdpa_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    sinks: torch.Tensor | None,
    softcap: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    seed: int,
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward returning (out, lse); arguments already resolved (see steel::sdpa)."""
    check_sdpa(q, k, v, attn_mask, True, sinks, op="sdpa_forward")
    args = (
        dropout_p,
        is_causal,
        scale,
        sinks,
        softcap,
        window_left,
        window_right,
        bottom_right,
        seed,
        offset,
    )
    out, lse = run(
        "sdpa",
        [q, k, v, attn_mask, sinks],
        _attn_options(
            dropout_p,
            is_causal,
            scale,
            softcap,
            window_left,
            window_right,
            bottom_right,
            seed,
            offset,
        ),
        lambda: ref.sdpa_forward(q, k, v, attn_mask, *args),
    )
    return out, lse


@sdpa_forward.register_fake
def _(
    q,
    k,
    v,
    attn_mask,
    dropout_p,
    is_causal,
    scale,
    sinks,
    softcap,
    window_left,
    window_right,
    bottom_right,
    seed,
    offset,
):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty(q.shape[:-1], dtype=ref.compute_dtype(q.dtype))


@torch.library.custom_op("steel::sdpa_backward", mutates_args=())
def sdpa_backward(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    sinks: torch.Tensor | None,
    softcap: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    seed: int,
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks); dsinks is an empty tensor when there are no sinks."""
    args = (
        dropout_p,
        is_causal,
        scale,
        sinks,
        softcap,
        window_left,
        window_right,
        bottom_right,
        seed,
        offset,
    )

    def reference():
        grads = ref.sdpa_backward(grad_out, grad_lse, q, k, v, lse, attn_mask, *args)
        return list(grads[:3]) + ([grads[3]] if sinks is not None else [])

    grads = run(
        "sdpa_backward",
        [grad_out, q, k, v, out, lse, attn_mask, sinks, grad_lse],
        _attn_options(
            dropout_p,
            is_causal,
            scale,
            softcap,
            window_left,
            window_right,
            bottom_right,
            seed,
            offset,
        ),
        reference,
    )
    dsinks = grads[3] if sinks is not None else q.new_empty(0)
    return grads[0], grads[1], grads[2], dsinks


@sdpa_backward.register_fake
def _(
    grad_out,
    grad_lse,
    q,
    k,
    v,
    out,
    lse,
    attn_mask,
    dropout_p,
    is_causal,
    scale,
    sinks,
    softcap,
    window_left,
    window_right,
    bottom_right,
    seed,
    offset,
):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


_SDPA_OPTIONS = (
    "dropout_p",
    "is_causal",
    "scale",
    "softcap",
    "window_left",
    "window_right",
    "bottom_right",
    "seed",
    "offset",
)


def _sdpa_setup(ctx, inputs, output):
    q, k, v, attn_mask, *rest = inputs
    options = dict(zip(_SDPA_OPTIONS[:3], rest[:3], strict=False))
    options.update(zip(_SDPA_OPTIONS[3:], rest[4:], strict=False))
    ctx.options = options
    ctx.backend = current_backend()
    ctx.save_for_backward(q, k, v, attn_mask, rest[3], *output)


def _sdpa_backward_autograd(ctx, grad_out, grad_lse):
    q, k, v, attn_mask, sinks, out, lse = ctx.saved_tensors
    o = ctx.options
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    with backend(ctx.backend):
        dq, dk, dv, dsinks = torch.ops.steel.sdpa_backward(
            grad_out,
            grad_lse,
            q,
            k,
            v,
            out,
            lse,
            attn_mask,
            o["dropout_p"],
            o["is_causal"],
            o["scale"],
            sinks,
            o["softcap"],
            o["window_left"],
            o["window_right"],
            o["bottom_right"],
            o["seed"],
            o["offset"],
        )
    return (
        dq,
        dk,
        dv,
        None,
        None,
        None,
        None,
        dsinks if sinks is not None else None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


sdpa_forward.register_autograd(_sdpa_backward_autograd, setup_context=_sdpa_setup)

_LIB.define(
    "sdpa(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float dropout_p=0.0, "
    "bool is_causal=False, float? scale=None, bool enable_gqa=False, *, Tensor? sinks=None, "
    'float softcap=0.0, int[]? window=None, str causal_align="top_left", int? seed=None, '
    "int offset=0) -> Tensor"
)


def _sdpa_parts(
    query,
    key,
    value,
    attn_mask,
    dropout_p,
    is_causal,
    scale,
    enable_gqa,
    sinks,
    softcap,
    window,
    causal_align,
    seed,
    offset,
):
    """Validates the public sdpa arguments; returns sdpa_forward's argument tuple."""
    softcap, left, right, bottom_right = _attention_options(
        "sdpa", dropout_p, softcap, window, causal_align, seed, offset
    )
    check_sdpa(query, key, value, attn_mask, enable_gqa, sinks)
    if (
        attn_mask is not None
        and attn_mask.is_floating_point()
        and attn_mask.requires_grad
        and torch.is_grad_enabled()
    ):
        raise NotImplementedError(
            "steel.sdpa: the gradient with respect to a float attn_mask is not implemented; "
            "detach the mask or use torch.nn.functional.scaled_dot_product_attention"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1]) if query.shape[-1] > 0 else 1.0
    return (
        query,
        key,
        value,
        attn_mask,
        float(dropout_p),
        bool(is_causal),
        float(scale),
        sinks,
        softcap,
        left,
        right,
        bottom_right,
        _resolve_seed(dropout_p, seed),
        offset,
    )


def _sdpa_composite(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    sinks=None,
    softcap=0.0,
    window=None,
    causal_align="top_left",
    seed=None,
    offset=0,
):
    parts = _sdpa_parts(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        sinks,
        softcap,
        window,
        causal_align,
        seed,
        offset,
    )
    return torch.ops.steel.sdpa_forward(*parts)[0]


_LIB.impl("sdpa", _sdpa_composite, "CompositeImplicitAutograd")


def _causal_bias(attn_mask, is_causal, causal_align, query, key):
    """Turns a torch.nn.attention.bias.CausalBias into (None, True, alignment)."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    if not isinstance(attn_mask, CausalBias):
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


def sdpa(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    sinks=None,
    softcap=None,
    window=None,
    causal_align="top_left",
    seed=None,
    offset=0,
    return_lse=False,
):
    """torch.nn.functional.scaled_dot_product_attention, plus keyword-only extensions.

    Same arguments and results as F.scaled_dot_product_attention ([*batch, heads, L, E] query,
    [*batch, heads_kv, S, E] key, [*batch, heads_kv, S, Ev] value; bool masks keep where True,
    float masks are added; rows that see no key are zero), and:
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
    attn_mask, is_causal, causal_align = _causal_bias(
        attn_mask, is_causal, causal_align, query, key
    )
    flat = query.dim() == 2 if torch.is_tensor(query) else False
    if flat:  # [L, E] inputs: one head, no batch
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    if not return_lse:
        out = torch.ops.steel.sdpa(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa,
            sinks=sinks,
            softcap=0.0 if softcap is None else softcap,
            window=window,
            causal_align=causal_align,
            seed=seed,
            offset=offset,
        )
        return out.squeeze(0) if flat else out
    parts = _sdpa_parts(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        sinks,
        softcap,
        window,
        causal_align,
        seed,
        offset,
    )
    out, lse = torch.ops.steel.sdpa_forward(*parts)
    return (out.squeeze(0), lse.squeeze(0)) if flat else (out, lse)


# ----------------------------------------------------------------------------- sdpa_varlen


@torch.library.custom_op("steel::sdpa_varlen_forward", mutates_args=())
def sdpa_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    sinks: torch.Tensor | None,
    softcap: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    seed: int,
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_varlen(q, k, v, sinks)
    check_cu_seqlens(
        "sdpa_varlen",
        cu_seqlens_q,
        cu_seqlens_k,
        q.shape[0],
        k.shape[0],
        max_seqlen_q,
        max_seqlen_k,
        q.device,
    )
    options = _attn_options(
        dropout_p, is_causal, scale, softcap, window_left, window_right, bottom_right, seed, offset
    )
    options.update(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    out, lse = run(
        "sdpa_varlen",
        [q, k, v, cu_seqlens_q, cu_seqlens_k, sinks],
        options,
        lambda: ref.sdpa_varlen_forward(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            dropout_p,
            is_causal,
            scale,
            sinks,
            softcap,
            window_left,
            window_right,
            bottom_right,
            seed,
            offset,
        ),
    )
    return out, lse


@sdpa_varlen_forward.register_fake
def _(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    is_causal,
    scale,
    sinks,
    softcap,
    window_left,
    window_right,
    bottom_right,
    seed,
    offset,
):
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=ref.compute_dtype(q.dtype))


@torch.library.custom_op("steel::sdpa_varlen_backward", mutates_args=())
def sdpa_varlen_backward(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    sinks: torch.Tensor | None,
    softcap: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    seed: int,
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    options = _attn_options(
        dropout_p, is_causal, scale, softcap, window_left, window_right, bottom_right, seed, offset
    )
    options.update(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)

    def reference():
        grads = ref.sdpa_varlen_backward(
            grad_out,
            grad_lse,
            q,
            k,
            v,
            lse,
            cu_seqlens_q,
            cu_seqlens_k,
            dropout_p,
            is_causal,
            scale,
            sinks,
            softcap,
            window_left,
            window_right,
            bottom_right,
            seed,
            offset,
        )
        return list(grads[:3]) + ([grads[3]] if sinks is not None else [])

    grads = run(
        "sdpa_varlen_backward",
        [grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks, grad_lse],
        options,
        reference,
    )
    dsinks = grads[3] if sinks is not None else q.new_empty(0)
    return grads[0], grads[1], grads[2], dsinks


@sdpa_varlen_backward.register_fake
def _(
    grad_out,
    grad_lse,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    is_causal,
    scale,
    sinks,
    softcap,
    window_left,
    window_right,
    bottom_right,
    seed,
    offset,
):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *rest = inputs
    ctx.rest = rest  # max_seqlen_q .. offset, with sinks at index 5 (kept as a tensor below)
    ctx.backend = current_backend()
    ctx.save_for_backward(q, k, v, cu_q, cu_k, rest[5], *output)


def _varlen_backward_autograd(ctx, grad_out, grad_lse):
    q, k, v, cu_q, cu_k, sinks, out, lse = ctx.saved_tensors
    rest = list(ctx.rest)
    rest[5] = sinks
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    with backend(ctx.backend):
        dq, dk, dv, dsinks = torch.ops.steel.sdpa_varlen_backward(
            grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, *rest
        )
    return (
        dq,
        dk,
        dv,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        dsinks if sinks is not None else None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


sdpa_varlen_forward.register_autograd(_varlen_backward_autograd, setup_context=_varlen_setup)

_LIB.define(
    "sdpa_varlen(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float dropout_p=0.0, "
    "bool is_causal=False, float? scale=None, *, Tensor? sinks=None, float softcap=0.0, "
    'int[]? window=None, str causal_align="top_left", int? seed=None, int offset=0) -> Tensor'
)


def _varlen_parts(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    is_causal,
    scale,
    sinks,
    softcap,
    window,
    causal_align,
    seed,
    offset,
):
    softcap, left, right, bottom_right = _attention_options(
        "sdpa_varlen", dropout_p, softcap, window, causal_align, seed, offset
    )
    check_varlen(query, key, value, sinks)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1]) if query.shape[-1] > 0 else 1.0
    return (
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        float(dropout_p),
        bool(is_causal),
        float(scale),
        sinks,
        softcap,
        left,
        right,
        bottom_right,
        _resolve_seed(dropout_p, seed),
        offset,
    )


def _varlen_composite(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    *,
    sinks=None,
    softcap=0.0,
    window=None,
    causal_align="top_left",
    seed=None,
    offset=0,
):
    parts = _varlen_parts(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        is_causal,
        scale,
        sinks,
        softcap,
        window,
        causal_align,
        seed,
        offset,
    )
    return torch.ops.steel.sdpa_varlen_forward(*parts)[0]


_LIB.impl("sdpa_varlen", _varlen_composite, "CompositeImplicitAutograd")


def sdpa_varlen(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    *,
    sinks=None,
    softcap=None,
    window=None,
    causal_align="top_left",
    seed=None,
    offset=0,
    return_lse=False,
):
    """Attention over packed variable-length sequences (flash-attn's varlen convention).

    query [total_q, heads, E], key [total_k, heads_kv, E], value [total_k, heads_kv, Ev];
    sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of query and cu_seqlens_k[b]:
    cu_seqlens_k[b+1] of key/value (int32 offsets starting at 0); max_seqlen_* bound the lengths.
    heads must be a multiple of heads_kv (grouped-query attention is implied). Options as in
    torch_steel.sdpa; is_causal and window align per sequence (causal_align defaults to
    "top_left" like sdpa; flash-attn's causal is "bottom_right"). lse is [heads, total_q].
    """
    if not return_lse:
        return torch.ops.steel.sdpa_varlen(
            query,
            key,
            value,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            is_causal,
            scale,
            sinks=sinks,
            softcap=0.0 if softcap is None else softcap,
            window=window,
            causal_align=causal_align,
            seed=seed,
            offset=offset,
        )
    parts = _varlen_parts(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        is_causal,
        scale,
        sinks,
        softcap,
        window,
        causal_align,
        seed,
        offset,
    )
    return torch.ops.steel.sdpa_varlen_forward(*parts)


# ----------------------------------------------------------------------------- gemm


def gemm_out_shape(a, b):
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return (*batch, a.shape[-2], b.shape[-1])


def check_gemm(a, b, bias, c, activation):
    op = "gemm"
    names = ["a", "b"] + (["bias"] if bias is not None else []) + (["c"] if c is not None else [])
    tensors = [t for t in (a, b, bias, c) if t is not None]
    _check_float_same(op, names, tensors)
    if a.dim() < 2 or b.dim() < 2:
        _fail(
            op,
            f"a and b must be at least 2-D ([..., M, K] and [..., K, N]), got ranks "
            f"{a.dim()} and {b.dim()}",
        )
    if a.shape[-1] != b.shape[-2]:
        _fail(
            op,
            f"inner dims differ: a is {list(a.shape)}, b is {list(b.shape)} "
            f"(K = {a.shape[-1]} vs {b.shape[-2]})",
        )
    try:
        shape = gemm_out_shape(a, b)
    except RuntimeError:
        _fail(
            op, f"batch dims of a {list(a.shape[:-2])} and b {list(b.shape[:-2])} do not broadcast"
        )
    if bias is not None and tuple(bias.shape) != (b.shape[-1],):
        _fail(op, f"bias must have shape [N] = [{b.shape[-1]}], got {list(bias.shape)}")
    if c is not None:
        try:
            ok = torch.broadcast_shapes(c.shape, shape) == torch.Size(shape)
        except RuntimeError:
            ok = False
        if not ok:
            _fail(
                op,
                f"c of shape {list(c.shape)} does not broadcast to the output shape {list(shape)}",
            )
    if activation not in ref.ACTIVATIONS:
        _fail(op, f"activation must be one of {ref.ACTIVATIONS}, got {activation!r}")


@torch.library.custom_op("steel::gemm", mutates_args=())
def _gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    c: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    activation: str = "none",
) -> torch.Tensor:
    """act(alpha * (a @ b) + beta * c + bias) (see torch_steel.gemm)."""
    check_gemm(a, b, bias, c, activation)
    (out,) = run(
        "gemm",
        [a, b, bias, c],
        {"alpha": alpha, "beta": beta, "activation": activation},
        lambda: [ref.gemm(a, b, bias, c, alpha, beta, activation)],
    )
    return out


@_gemm_op.register_fake
def _(a, b, bias=None, c=None, alpha=1.0, beta=0.0, activation="none"):
    check_gemm(a, b, bias, c, activation)
    return a.new_empty(gemm_out_shape(a, b))


def _gemm_setup(ctx, inputs, output):
    a, b, bias, c, ctx.alpha, ctx.beta, ctx.activation = inputs
    ctx.backend = current_backend()
    ctx.save_for_backward(a, b, bias, c)


def _gemm_backward(ctx, grad):
    a, b, bias, c = ctx.saved_tensors
    # The dispatcher drops trailing arguments left at their defaults, so needs_input_grad can
    # be shorter than the schema: pad it.
    needs = (*ctx.needs_input_grad, False, False, False, False)
    gemm_op = torch.ops.steel.gemm
    with backend(ctx.backend):
        if ctx.activation == "none":
            dz = grad
        else:
            # Recompute the pre-activation (one more GEMM) instead of keeping it alive.
            z = gemm_op(a, b, bias, c, ctx.alpha, ctx.beta)
            ct = ref.compute_dtype(z.dtype)
            dz = (grad.to(ct) * ref.activation_grad(z.to(ct), ctx.activation)).to(grad.dtype)
        da = db = dbias = dc = None
        if needs[0]:
            da = gemm_op(dz, b.mT, alpha=ctx.alpha).sum_to_size(a.shape)
        if needs[1]:
            db = gemm_op(a.mT, dz, alpha=ctx.alpha).sum_to_size(b.shape)
    if needs[2]:
        dbias = dz.reshape(-1, dz.shape[-1]).sum(0)
    if needs[3]:
        dc = (dz * ctx.beta).sum_to_size(c.shape)
    return da, db, dbias, dc, None, None, None


_gemm_op.register_autograd(_gemm_backward, setup_context=_gemm_setup)


def gemm(a, b, *, bias=None, c=None, alpha=1.0, beta=0.0, activation="none"):
    """act(alpha * (a @ b) + beta * c + bias); a [..., M, K], b [..., K, N], bias [N].

    Batch dims broadcast like torch.matmul; c broadcasts to the output and is ignored when
    beta == 0 (like addmm); activation is none, relu, gelu, gelu_tanh or silu. Same as
    torch.ops.steel.gemm(a, b, bias, c, alpha, beta, activation).
    """
    return torch.ops.steel.gemm(a, b, bias, c, float(alpha), float(beta), activation)


def linear(x, weight, bias=None, activation="none"):
    """act(x @ weight.T + bias) through steel::gemm (weight [out, in], as nn.Linear)."""
    if not torch.is_tensor(x) or x.dim() < 1:
        raise ValueError("steel.linear: x must be a tensor of shape [..., in_features]")
    if not torch.is_tensor(weight) or weight.dim() != 2:
        raise ValueError("steel.linear: weight must be [out_features, in_features]")
    if x.dim() == 1:
        return gemm(x.unsqueeze(0), weight.t(), bias=bias, activation=activation).squeeze(0)
    return gemm(x, weight.t(), bias=bias, activation=activation)
