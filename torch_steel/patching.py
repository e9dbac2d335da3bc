"""Steel as PyTorch's F.scaled_dot_product_attention on MPS, at the dispatcher.

PyTorch's registry of attention providers (torch.nn.attention.register_flash_attention_impl /
activate_flash_attention_impl, the one FA3 and FA4 use) knows steel as "steel" once torch_steel
is imported; nothing changes until it is activated, by

    torch.nn.attention.activate_flash_attention_impl("steel")      # or
    torch_steel.patch()        # the same switch; also a context manager; torch_steel.unpatch()

Activating registers a kernel for the op `aten::scaled_dot_product_attention` at the MPS
dispatch keys (MPS and AutogradMPS). Every caller of F.sdpa then reaches it, whatever route it
takes: the Python function (even a reference taken before activation), C++
at::scaled_dot_product_attention, nn.MultiheadAttention and the Transformer layers, graphs that
torch.compile traces (the kernel runs while AOTAutograd traces, so the graph holds steel's ops),
with grad, under no_grad and under inference_mode (the backend key serves the calls that skip
autograd). Under torch.autocast, PyTorch's autocast kernel casts first, as for its own kernels.

The kernel serves a call with steel::sdpa when steel can: MPS tensors under the "auto" and
"metal" backends (a refused Metal plan or a missing extension runs PyTorch's own kernel, never
reference math silently), CPU tensors under "sim", any registered device under "reference".
Every other call, and any call steel does not serve (invalid arguments, which then get PyTorch's
own error, out-of-range dropout_p, torch.func transforms, forward-mode AD, dropout inside a
compiled graph), runs PyTorch's own implementation: the op's CompositeImplicitAutograd kernel,
which picks PyTorch's backend for the device as usual. Under TORCH_STEEL_STRICT=1 a refused
plan is an error here too (PlanRefused) instead of going to PyTorch's kernel.
Nested (jagged) tensors never reach these keys, so they run PyTorch's path.

While active, torch.nn.attention.varlen.varlen_attn (the op torch_attn::_varlen_attn and its
backward, at the same device keys) runs steel::sdpa_varlen; PyTorch has no MPS kernel for it,
so there a refused plan falls back to reference math with steel's warning. Calls with
seqused_k, block_table or num_splits > 1 run PyTorch's own implementation.

CPU keys are registered only on request (patch(devices=("mps", "cpu")) or
TORCH_STEEL_PATCH_DEVICES=mps,cpu when activated through torch.nn.attention), so that CPU users
are not affected unless they ask; the tests run the same machinery on CPU that way.
"""

import os
import sys
import threading
from dataclasses import dataclass

import torch
from torch.autograd import forward_ad as _forward_ad
from torch.nn import attention as _attention

from . import ops, reference, validation
from .backends import current_backend, refusals_raise, strict
from .errors import PlanRefused
from .ops import attention_ops, varlen_ops

NAME = "steel"
DEVICES = ("mps", "cpu")
_KEYS = {"mps": ("MPS", "AutogradMPS"), "cpu": ("CPU", "AutogradCPU")}

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_CIA = torch._C.DispatchKey.CompositeImplicitAutograd
_lock = threading.RLock()
_devices_next = None  # devices of the next activation (patch(devices=...)), else the env/default
_devices_active = ()


def _devices_from_env():
    raw = os.environ.get("TORCH_STEEL_PATCH_DEVICES", "").strip().lower()
    devices = tuple(d.strip() for d in raw.split(",") if d.strip()) or ("mps",)
    return _check_devices(devices, "TORCH_STEEL_PATCH_DEVICES")


def _check_devices(devices, what="devices"):
    devices = tuple(dict.fromkeys(devices))
    unknown = [d for d in devices if d not in DEVICES]
    if unknown or not devices:
        raise ValueError(f"torch_steel: {what} must name some of {DEVICES}, got {devices}")
    return devices


def _pytorch_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                  scale=None, enable_gqa=False):  # fmt: skip
    """PyTorch's own F.sdpa for this call: the op's CompositeImplicitAutograd kernel, which
    selects PyTorch's backend (flash, efficient, math, MPS) as if steel were not there."""
    return _SDPA._op_dk(
        _CIA, query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


def _backend_serves(device):
    name = current_backend()
    return device in _devices_active and (
        name == "reference"
        or (name == "sim" and device == "cpu")
        or (name in ("auto", "metal") and device == "mps")
    )


def _serves(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
    """Whether steel serves this intercepted call (see the module docstring)."""
    tensors = [t for t in (query, key, value, attn_mask) if t is not None]
    if not all(torch.is_tensor(t) and not t.is_nested for t in tensors):
        return False
    if not _backend_serves(query.device.type):
        return False
    if not 0.0 <= dropout_p <= 1.0 or min(query.dim(), key.dim(), value.dim()) < 2:
        return False  # PyTorch's own error
    if torch._C._functorch.peek_interpreter_stack() is not None:
        # Inside torch.func transforms (grad, vmap, jvp, ...): PyTorch's kernels have every
        # rule; steel's ops have no forward-mode AD and vmap would loop over the examples.
        return False
    if _forward_ad._current_level >= 0 and any(
        _forward_ad.unpack_dual(t).tangent is not None for t in tensors
    ):
        return False  # forward-mode AD: steel's ops have no forward derivative
    if dropout_p > 0 and torch._guards.detect_fake_mode((query,)) is not None:
        # Traced by torch.compile: steel's dropout seed is drawn as a Python int when the op is
        # called, which a graph cannot hold; PyTorch's dropout RNG is traceable.
        return False
    try:
        # A CausalBias reaches the op itself only when called as the aten op (F.sdpa leaves it
        # to the bias object's __torch_function__); steel::sdpa takes it as PyTorch means it.
        mask, _, _ = attention_ops._causal_bias(attn_mask, is_causal, "top_left", query, key)
        q, k, v = attention_ops._broadcast_qkv(query, key, value, enable_gqa)
        validation.check_sdpa(q, k, v, mask, enable_gqa, None)
    except (ValueError, TypeError):
        return False  # PyTorch reports its own error for this call
    return True


def _steel_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                  scale=None, enable_gqa=False):  # fmt: skip
    """The kernel registered for aten::scaled_dot_product_attention while steel is active."""
    args = (query, key, value, attn_mask, dropout_p, is_causal)
    if _serves(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        try:
            with refusals_raise():
                return ops.sdpa(*args, scale=scale, enable_gqa=enable_gqa)
        except PlanRefused:
            if strict():
                raise  # TORCH_STEEL_STRICT=1: a call steel does not serve is an error
            # the Metal path cannot serve it: PyTorch's own MPS kernel does
    return _pytorch_sdpa(*args, scale=scale, enable_gqa=enable_gqa)


def _varlen_module():
    from torch.nn.attention import varlen

    return varlen


def _varlen_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                   scale=None, window_size=None, enable_gqa=False, seqused_k=None,
                   block_table=None, num_splits=None):  # fmt: skip
    """torch_attn::_varlen_attn (torch.nn.attention.varlen.varlen_attn) while steel is active:
    steel::sdpa_varlen_forward (flash-attn's bottom-right causal and window alignment)."""
    args = (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale, window_size,
            enable_gqa, seqused_k, block_table, num_splits)  # fmt: skip
    left, right = window_size if window_size is not None else (-1, -1)
    if not _backend_serves(query.device.type) or value.shape[-1] != query.shape[-1]:
        return _varlen_module()._varlen_attn._init_fn(*args)  # PyTorch's own (flash, cuDNN)
    if cu_seq_k is None or seqused_k is not None or block_table is not None or num_splits:
        # A KV cache (paged or not) and split counts: the decode kernels, as without patch().
        from . import varlen

        return varlen.varlen_attn_kernel(*args)
    # PyTorch has no varlen kernel for MPS: a refused Metal plan falls back to reference math
    # with steel's one-time warning (TORCH_STEEL_STRICT=1 makes it an error).
    inputs = varlen_ops._varlen_inputs(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                       0.0, bool(is_causal), scale, None, None, (left, right),
                                       "bottom_right", None, 0)  # fmt: skip
    out, lse = torch.ops.steel.sdpa_varlen_forward(*inputs)
    return out, lse.float(), torch.zeros(2, dtype=torch.uint64, device=query.device)


def _varlen_backward_kernel(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q,
                            max_k, is_causal, rng_state, scale=None,
                            window_size=None):  # fmt: skip
    """torch_attn::_varlen_attn_backward while steel is active: steel::sdpa_varlen_backward."""
    if not _backend_serves(query.device.type):
        return _varlen_module()._varlen_attn_backward._init_fn(
            grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
            rng_state, scale, window_size,
        )  # fmt: skip
    left, right = window_size if window_size is not None else (-1, -1)
    inputs = varlen_ops._varlen_inputs(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                       0.0, bool(is_causal), scale, None, None, (left, right),
                                       "bottom_right", None, 0)  # fmt: skip
    lse = lse.to(reference.compute_dtype(query.dtype))
    dq, dk, dv, _ = torch.ops.steel.sdpa_varlen_backward(grad_out, None, *inputs[:3], out, lse,
                                                         *inputs[3:])  # fmt: skip
    return dq, dk, dv


def _inductor_tables():
    """Inductor's decomposition tables, when Inductor is loaded (importing it takes seconds)."""
    module = sys.modules.get("torch._inductor.decomposition")
    if module is None:
        return []
    return [module.decompositions, module.fast_random_decomps()]


@dataclass
class _Handle:
    """What activate_flash_attention_impl keeps alive; remove() unregisters the kernels."""

    library: torch.library.Library | None
    varlen_library: torch.library.Library
    devices: tuple
    replaced: list  # (decomposition table, its previous entry for aten.sdpa or None)
    cache_tag: tuple  # (torch.compiler.config.cache_key_tag before, the one set)

    def remove(self):
        global _devices_active
        with _lock:
            if self.library is None:
                return
            self.library._destroy()
            self.varlen_library._destroy()
            self.library = None
            if _SDPA.py_kernels.get(_CIA) is _steel_kernel:
                del _SDPA.py_kernels[_CIA]
                _SDPA._dispatch_cache.clear()
            for table, previous in self.replaced:
                if table.get(_SDPA) is _steel_kernel:
                    if previous is None:
                        table.pop(_SDPA, None)
                    else:
                        table[_SDPA] = previous
            self.replaced = []
            before, ours = self.cache_tag
            if torch.compiler.config.cache_key_tag == ours:
                torch.compiler.config.cache_key_tag = before
            _devices_active = ()


def _register(devices=None):
    """register_fn of the "steel" attention provider: registers the kernels at the dispatcher.

    Besides the device keys, the kernel goes where graph tracing looks for the op's
    decomposition, so that a compiled graph holds steel's ops also when autograd does not
    run (an inference graph reaches the tracer's own dispatch mode before the backend key):
    the op's Python CompositeImplicitAutograd kernel (which decomposition tables built from
    now on take) and the entries of Inductor's tables if Inductor is loaded already. The
    kernel passes every call it does not serve to PyTorch's C++ composite kernel.

    torch.compile's on-disk caches (FX graph, AOTAutograd) key a graph by the code that calls
    F.sdpa, not by what serves it: torch.compiler.config.cache_key_tag gets a steel tag while
    steel is active, so a graph traced with steel and one traced without are never confused.
    """
    global _devices_active
    with _lock:
        if devices is None:
            devices = _devices_next if _devices_next is not None else _devices_from_env()
        devices = _check_devices(devices)
        library = torch.library.Library("aten", "IMPL")
        for device in devices:
            for key in _KEYS[device]:
                library.impl("scaled_dot_product_attention", _steel_kernel, key)
        _varlen_module()  # defines torch_attn::_varlen_attn
        varlen_library = torch.library.Library("torch_attn", "IMPL")
        for device in devices:
            key = _KEYS[device][0]  # below the op's own autograd
            varlen_library.impl("_varlen_attn", _varlen_kernel, key)
            varlen_library.impl("_varlen_attn_backward", _varlen_backward_kernel, key)
        if _CIA not in _SDPA.py_kernels:
            _SDPA.py_impl(_CIA)(_steel_kernel)
        replaced = []
        for table in _inductor_tables():
            replaced.append((table, table.get(_SDPA)))
            table[_SDPA] = _steel_kernel
        before = torch.compiler.config.cache_key_tag
        ours = f"{before}|torch_steel:{','.join(devices)}"
        torch.compiler.config.cache_key_tag = ours
        _devices_active = devices
        return _Handle(library, varlen_library, devices, replaced, (before, ours))


_attention.register_flash_attention_impl(NAME, register_fn=_register)


class _Patch:
    """Returned by patch(); as a context manager it restores the state from before patch()."""

    def __init__(self, previous):
        self._previous = previous  # (provider name or None, its devices)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        name, devices = self._previous
        with _lock:
            if name is None:
                unpatch()
            elif (name, devices) != (_attention.current_flash_attention_impl(), _devices_active):
                _activate(name, devices)
        return False


def _activate(name, devices):
    global _devices_next
    _devices_next = devices
    try:
        _attention.activate_flash_attention_impl(name)
    finally:
        _devices_next = None


def is_patched() -> bool:
    """Whether steel is the active attention provider."""
    return _attention.current_flash_attention_impl() == NAME


def active_devices() -> tuple:
    """The device types whose F.sdpa calls steel intercepts (empty when not active)."""
    return _devices_active if is_patched() else ()


def patch(devices=None):
    """Activate steel as F.scaled_dot_product_attention's provider (the same as
    torch.nn.attention.activate_flash_attention_impl("steel")). Idempotent and thread-safe.

    devices: the device types to intercept, ("mps",) by default (TORCH_STEEL_PATCH_DEVICES);
    ("mps", "cpu") also routes CPU tensors, which steel serves under the "sim" and "reference"
    backends (for tests). Use as `torch_steel.patch()` (until unpatch()) or
    `with torch_steel.patch(): ...`, which restores the provider from before it on exit.
    """
    with _lock:
        devices = _check_devices(devices) if devices is not None else _devices_from_env()
        previous = (_attention.current_flash_attention_impl(), _devices_active)
        if previous != (NAME, devices):
            _activate(NAME, devices)
    return _Patch(previous)


def unpatch():
    """Deactivate steel, restoring PyTorch's own attention (no-op when steel is not active)."""
    with _lock:
        if is_patched():
            _attention.restore_flash_attention_impl()
