"""PyTorch's composite paths, op by op, as torch itself runs them (issue 24, deliverable 5: "model
it from the ops it runs").

    traced_ops(fn, *args)            the kernels fn dispatches: name, FLOPs, bytes read and written
    sdpa_training_ops(B, Hq, Hkv, L, S, D, causal, dropout_p, dtype)
                                     F.sdpa with grad on MPS: torch's
                                     _scaled_dot_product_attention_math, forward then backward

F.sdpa with grad on MPS runs `_scaled_dot_product_attention_math` (attention.cpp: the MPS graph
path `_scaled_dot_product_attention_math_for_mps` is taken only without grad). Its op list is not
restated here by hand: the function runs on meta tensors (no memory, no arithmetic) under a
TorchDispatchMode that records every aten op that reaches a kernel, forward and autograd's
backward, with its tensors' shapes and dtypes. So the list follows the installed torch's source,
including its choices (half and bfloat inputs upcast to float32, so the L x S tensors are float32;
the causal mask built with ones, tril and where; _safe_softmax's rows that see nothing zeroed).

What counts as a kernel (one dispatch on the GPU):
- an op with a backend kernel (CPU's registration stands for the backends': native_functions.yaml
  gives MPS the same ops); an op with only a composite kernel (CompositeExplicitAutograd or
  CompositeImplicitAutograd: _to_copy, clone, ones, _safe_softmax, softmax) is run through that
  kernel under the mode and replaced by the ops it calls; one that calls none (copy_) is a kernel;
- not: views (transpose, expand, view, _unsafe_view, detach), allocations (empty*), which move no
  data.
Assumption: the branches the source takes on meta tensors are those it takes on MPS (the function
has no device test on this path in torch 2.13; a branch on the device would be missed).

Each kernel's cost inputs: bytes read = its input tensors (a broadcast input counted once: the
elements its nonzero strides reach) and written = its outputs (an out= or in-place argument is
written, and read too unless the op overwrites it: copy_, fill_, zero_); FLOPs = 2 b m n k for
the matrix products (bmm, mm, baddbmm, addmm: "matmul"), otherwise an ALU estimate per element:
the output's elements (inputs' for reductions), 5 per element for softmax (max, subtract, exp,
sum, divide) and 3 for its backward (multiply, row sum, multiply-subtract). These are costed at
the chip's roofline by side_by_side.composite_time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_MATMULS = {"aten::bmm", "aten::mm", "aten::baddbmm", "aten::addmm"}
_REDUCTIONS = {"aten::sum", "aten::all", "aten::any", "aten::amax", "aten::amin", "aten::mean"}
_PER_ELEMENT = {"aten::softmax": 5, "aten::_softmax": 5, "aten::_softmax_backward_data": 3}
_OVERWRITE = {"aten::copy_", "aten::fill_", "aten::zero_"}
# Ops that return an alias: no data moves (views and allocations are told apart in the mode).
_FREE = {"aten::_unsafe_view", "aten::alias", "aten::lift_fresh", "aten::detach"}


def _has(func, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)


def _reached_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor's view reaches (a stride-0 dimension once)."""
    n = math.prod(s for s, st in zip(t.shape, t.stride(), strict=True) if st != 0)
    return n * t.element_size()


def _matmul_flops(name: str, args) -> int:
    tensors = [x for x in args if isinstance(x, torch.Tensor)]
    # bmm / mm (a, b); baddbmm / addmm (self, a, b)
    a, b = tensors[1:3] if name in ("aten::baddbmm", "aten::addmm") else tensors[:2]
    *batch, m, k = a.shape
    n = b.shape[-1]
    return 2 * math.prod(batch) * m * n * k


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        base = func.name().split(".")[0]
        if func.is_view or base in _FREE or base.startswith(("aten::empty", "aten::new_empty")):
            return func(*args, **kwargs)
        if not _has(func, "CPU"):
            # A composite: run its kernel with the mode on, so that the ops it calls are seen.
            if _has(func, "CompositeImplicitAutograd"):
                before = len(self.ops)
                with self:
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented and len(self.ops) > before:
                    return out
            elif _has(func, "CompositeExplicitAutograd"):
                before = len(self.ops)
                with self:
                    out = func._op_dk(
                        torch._C.DispatchKey.CompositeExplicitAutograd, *args, **kwargs
                    )
                if len(self.ops) > before:
                    return out
                self._record(func, args, kwargs, out)
                return out
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        base = func.name().split(".")[0]
        schema = func._schema
        written_args: list[torch.Tensor] = []
        read_args: list[torch.Tensor] = []
        for arg, value in zip(schema.arguments, [*args, *[None] * len(schema.arguments)]):
            value = kwargs.get(arg.name, value) if arg.kwarg_only or arg.name in kwargs else value
            tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
            if arg.alias_info is not None and arg.alias_info.is_write:
                written_args += tensors
                if base not in _OVERWRITE and arg.name != "out":
                    read_args += tensors
            else:
                read_args += tensors
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        written = written_args or outs
        read_bytes = sum(_reached_bytes(t) for t in read_args)
        written_bytes = sum(t.numel() * t.element_size() for t in written)
        if base in _MATMULS:
            flops = _matmul_flops(base, [*args, *kwargs.values()])
        elif base in _REDUCTIONS:
            flops = sum(t.numel() for t in read_args)
        else:
            flops = _PER_ELEMENT.get(base, 1) * sum(t.numel() for t in written)
        shape = "x".join(map(str, written[0].shape)) if written else ""
        self.ops.append(
            {
                "op": f"{base.removeprefix('aten::')} {shape}".strip(),
                "aten": str(func),
                "flops": float(flops),
                "read": read_bytes,
                "written": written_bytes,
                "bytes": read_bytes + written_bytes,
                "matmul": base in _MATMULS,
                "shapes": [tuple(t.shape) for t in read_args],
                "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in read_args + outs}),
            }
        )


def traced_ops(fn: Callable[[], Any]) -> list[dict[str, Any]]:
    """The kernels that fn() dispatches, in order (see the module's docstring): {"op", "aten",
    "flops", "read", "written", "bytes", "matmul", "shapes" (of the tensors read), "dtypes"}."""
    recorder = _Recorder()
    with recorder:
        fn()
    return recorder.ops


def sdpa_training_ops(B, Hq, Hkv, L, S, D, causal, dropout_p, dtype) -> list[dict[str, Any]]:
    """The kernels of F.sdpa's math path with grad: forward, then autograd's backward from a
    gradient of the output (q, k, v, the gradient of shapes (B, Hq, L, D), (B, Hkv, S, D))."""

    def meta(*shape, grad=True):
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)

    q, k, v = meta(B, Hq, L, D), meta(B, Hkv, S, D), meta(B, Hkv, S, D)
    grad_out = meta(B, Hq, L, D, grad=False)

    def step():
        out, _ = torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, None, dropout_p, causal, None, scale=1 / math.sqrt(D), enable_gqa=Hq != Hkv
        )
        out.backward(grad_out)

    return traced_ops(step)
