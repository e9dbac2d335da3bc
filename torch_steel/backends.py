"""Which implementation serves an op call: Metal, the CPU Metal simulator, or reference math.

  "auto"       MPS tensors -> Metal kernels; everything else -> reference math.
  "metal"      MPS tensors -> Metal kernels; other devices, or no Metal extension, is an error.
  "sim"        CPU tensors -> the shipped Metal kernels run in the simulator (torch_steel.sim).
  "reference"  reference math (torch ops) on any device.

The choice comes from the innermost `with torch_steel.backend(name):`, else the
TORCH_STEEL_BACKEND environment variable, else "auto". A call that the Metal launch plan refuses
(an unsupported dtype, shape or option; an op without a kernel yet) falls back to reference math
with a one-time warning naming the reason; TORCH_STEEL_STRICT=1 turns that into an error.
"""

import contextlib
import importlib
import os
import sys
import threading
import warnings

from .errors import PlanRefused

BACKENDS = ("auto", "metal", "sim", "reference")


class _ThreadState(threading.local):
    """Per thread (torch.compile traces threading.local reads, and guards on them, but not
    ContextVar). Every thread's state starts with its attributes set: reading a missing one
    with getattr's default raises and catches an AttributeError, about 0.5 us of every op call
    (issue 16), and a class attribute in its place would hide a thread's own value from
    torch.compile's guards."""

    def __init__(self):
        self.name = None  # the innermost `with backend(name):`
        self.refusals_raise = False  # inside `with refusals_raise():`


_local = _ThreadState()
# os.environ's own mapping (encoded names and values, kept in step with every change made
# through os.environ), where os's implementation has one: os.environ.get of an unset variable
# raises and catches a KeyError, about 1.3 us of every op call (issue 16), a lookup here 60 ns.
_ENVIRON = getattr(os.environ, "_data", None)
_BACKEND_VARIABLE = "TORCH_STEEL_BACKEND"
_BACKEND_VARIABLE_KEY = (
    os.environ.encodekey(_BACKEND_VARIABLE) if isinstance(_ENVIRON, dict) else None
)
_warned = set()
_warned_lock = threading.Lock()


class FallbackWarning(UserWarning):
    """A Metal (or simulated Metal) path could not serve a call; reference math ran instead.

    .op is the op name (e.g. "sdpa_backward"), .reason why the Metal path did not serve it.
    """

    def __init__(self, op, reason):
        super().__init__(
            f"steel::{op}: {reason}; using reference math instead (warned once; set "
            "TORCH_STEEL_STRICT=1 to make this an error)"
        )
        self.op = op
        self.reason = reason


def _check_name(name):
    if name not in BACKENDS:
        raise ValueError(f"unknown torch_steel backend {name!r}; expected one of {BACKENDS}")
    return name


def current_backend() -> str:
    """The backend name in effect for this thread/context."""
    name = _local.name
    if name is None:
        if _BACKEND_VARIABLE_KEY is not None:
            raw = _ENVIRON.get(_BACKEND_VARIABLE_KEY)
            if raw is None:
                return "auto"
            name = os.environ.decodevalue(raw)
        else:
            name = os.environ.get(_BACKEND_VARIABLE, "")
        name = name.strip().lower() or "auto"
        if name not in BACKENDS:
            raise ValueError(
                f"TORCH_STEEL_BACKEND={name!r} is not a torch_steel backend; expected one of "
                f"{BACKENDS}"
            )
    return name


@contextlib.contextmanager
def backend(name: str):
    """Context manager selecting the backend of torch_steel ops inside the block."""
    previous = _local.name
    _local.name = _check_name(name)
    try:
        yield name
    finally:
        _local.name = previous


@contextlib.contextmanager
def refusals_raise():
    """Inside the block, a Metal path that cannot serve a call on MPS tensors (a refused plan, no
    extension) raises PlanRefused instead of falling back to reference math.

    Used by the F.scaled_dot_product_attention integration (torch_steel.patching), which then
    runs PyTorch's own MPS kernel: faster there than reference math. The "metal" backend without
    the extension stays an error; the "sim" and "reference" backends are unaffected (the
    simulator still falls back with its warning).
    """
    previous = _local.refusals_raise
    _local.refusals_raise = True
    try:
        yield
    finally:
        _local.refusals_raise = previous


def strict() -> bool:
    return os.environ.get("TORCH_STEEL_STRICT", "").strip().lower() in ("1", "true", "yes", "on")


def _optional_module(name):
    """torch_steel.sim / torch_steel.metal, or None when that part is not installed."""
    module = sys.modules.get(f"torch_steel.{name}")  # every op call on MPS asks: 2 us saved
    if module is not None:
        return module
    try:
        return importlib.import_module(f"torch_steel.{name}")
    except ImportError as error:
        if error.name != f"torch_steel.{name}":
            raise  # the module exists but is broken: say so instead of hiding it
        return None


def sim_status():
    """(available, why-not) of the CPU Metal simulator."""
    sim = _optional_module("sim")
    if sim is None:
        return False, "torch_steel.sim is not installed"
    try:
        ok = sim.available()
    except Exception as error:  # a half-installed simulator must not break the ops
        return False, f"the Metal simulator failed to load: {type(error).__name__}: {error}"
    if not ok:
        return False, (
            "the Metal simulator is unavailable: torch_steel.sim.available() is False (clang-19 "
            "and libclang-rt-19-dev missing, or the simulator build failed)"
        )
    return True, ""


def metal_status():
    """(available, why-not) of the Metal extension."""
    import torch

    if not torch.backends.mps.is_available():
        return False, "no MPS device"
    metal = _optional_module("metal")
    if metal is None:
        return False, "torch_steel.metal is not installed"
    if not torch.backends.mps.is_macos_or_newer(*metal.MIN_MACOS):
        return False, "the kernels need macOS {}.{} or newer (Metal 3.1)".format(*metal.MIN_MACOS)
    problem = metal.extension_problem()
    if problem is not None:
        return False, problem
    if metal._extension() is None:  # the rest of metal.available() was checked above
        return False, "the torch_steel Metal extension is not built"
    return True, ""


def _fallback(op, reason, every_op=False):
    """Warn once per (op, reason) that reference math serves op; raise instead in strict mode.

    every_op: the reason holds for every op (the Metal path is unavailable in this process), so
    it is warned once in all.
    """
    if strict():
        raise PlanRefused(f"steel::{op}: {reason} (TORCH_STEEL_STRICT=1 forbids the fallback)")
    key = (None if every_op else op, reason)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(FallbackWarning(op, reason), stacklevel=3)


def _device_type(tensors):
    for t in tensors:
        if t is not None:
            if t.is_mps:  # a property: t.device makes a torch.device per call (about 1 us)
                return "mps"
            return "cpu" if t.is_cpu else t.device.type
    return "cpu"


def run(op, tensors, options, reference):
    """Serve op on the selected backend.

    tensors: the op's tensor arguments (None for absent optionals), passed in this order to
    run_op; options: name -> number | bool | str; reference: a zero-argument function computing
    the same outputs (a list) with reference math.
    """
    name = current_backend()
    device = _device_type(tensors)
    if name == "reference":
        return reference()
    if name == "sim":
        if device != "cpu":
            raise RuntimeError(
                f"steel::{op}: backend 'sim' runs CPU tensors through the simulator, got {device}"
            )
        ok, why = sim_status()
        if not ok:
            raise NotImplementedError(f"steel::{op}: backend 'sim' is not available: {why}")
        from . import sim

        try:
            return list(sim.run_op(op, list(tensors), dict(options)))
        except PlanRefused as refusal:
            _fallback(op, f"simulated Metal plan refused: {refusal}")
            return reference()
    if device != "mps":
        if name == "metal":
            raise RuntimeError(f"steel::{op}: backend 'metal' needs MPS tensors, got {device}")
        return reference()
    raising = _local.refusals_raise
    metal = sys.modules.get("torch_steel.metal")
    if metal is None or not metal._loaded:  # loaded kernels: it was available, and stays so
        ok, why = metal_status()
        if not ok and raising and name == "auto":
            raise PlanRefused(f"steel::{op}: {why}")
        if not ok:
            if name == "metal":
                raise RuntimeError(f"steel::{op}: backend 'metal' is not available: {why}")
            _fallback(op, why, every_op=True)
            return reference()
        metal = _optional_module("metal")
    try:
        return metal.run_op(op, tensors, options)
    except PlanRefused as refusal:
        if raising:
            raise
        _fallback(op, f"Metal plan refused: {refusal}")
        return reference()
