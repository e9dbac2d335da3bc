"""The Metal back end: launch plans encoded on PyTorch's MPS stream (macOS).

    available()                    the extension torch_steel._C_metal is built and MPS works
    run_op(op, tensors, options)   plan `op`, encode it on the current MPS stream, return outputs

The extension is built by setup.py on macOS only (mps_src/mps/build_macos.py). It takes its
kernels from steel.metallib when Xcode's Metal toolchain was there at install time, otherwise it
compiles the installed shader sources (metal_src/*.metal) with the Metal runtime compiler the
first time a process needs a kernel, which this module announces once.

The extension is used only when it was built against the running torch (the build records the
version in _C_metal_build.json) and imports; otherwise available() is False and
extension_problem() says why, once decided per process, and the ops keep to reference math.

A refused plan raises torch_steel.errors.PlanRefused, for the op layer to fall back to reference
math; anything else the extension raises (bad input, a kernel missing from the library) is an
error and propagates.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from torch_steel.errors import PlanRefused

# The C++ side raises refusals as c10::Error messages starting with this (mps_src/mps/host.h).
REFUSED_PREFIX = "steel plan refused: "
PACKAGE_DIR = Path(__file__).resolve().parent
METALLIB = "steel.metallib"
# The MSL 4 tensor-op kernels (M5's matrix units): their own library, built with a macOS 26.2+
# SDK, loaded after the main one only where the device reports Metal 4 (the extension decides;
# absent, the plans keep to the simdgroup kernels). Their sources end in _msl4.metal.
TENSOR_OPS_METALLIB = "steel_tensor_ops.metallib"
TENSOR_OPS_SUFFIX = "_msl4.metal"
SOURCE_DIR = "metal_src"

_load_lock = threading.Lock()
_loaded = False
# Why the library could not be loaded, once that failed: later calls raise it again at once
# instead of recompiling every shader (seconds) on every op call.
_load_failure: str | None = None


EXTENSION = "torch_steel._C_metal"
# Written next to the extension by the Mac build (mps_src/mps/build_macos.py): the torch version
# it was compiled against.
BUILD_INFO = "_C_metal_build.json"


@functools.cache
def _load_extension():
    """(the extension module or None, why it is not used or None); decided once per process.

    No extension file (every platform but macOS, or a torch without MPS at build time) is not a
    problem. An extension built against another torch is not imported at all: it is tied to the
    C++ ABI of the torch it was compiled with, and a mismatch may fail to load or, worse, load.
    An extension that does not import (a missing symbol after a torch upgrade, a missing
    framework) is reported the same way instead of raising from every op call. CPython names
    that ImportError with the short name ("_C_metal"), so it is recognized by where it happens
    (the extension's own import), not by its .name.
    """
    try:
        spec = importlib.util.find_spec(EXTENSION)
    except ImportError:
        spec = None
    if spec is None or spec.origin is None:
        return None, None
    reinstall = (
        "rebuild torch-steel against this torch with `pip install --no-build-isolation "
        "--force-reinstall --no-deps <its checkout or sdist>`"
    )
    built_for = _built_for(Path(spec.origin).parent / BUILD_INFO)
    running = str(torch.__version__)
    if built_for != running:
        return None, (
            f"torch-steel's Metal extension was built against torch {built_for or '(unknown)'}, "
            f"but torch {running} is running; {reinstall}"
        )
    try:
        return importlib.import_module(EXTENSION), None
    except ImportError as error:
        return None, f"torch-steel's Metal extension does not load ({error}); {reinstall}"


def _built_for(path: Path) -> str | None:
    """The torch version recorded in the build info file, or None when it is absent or broken."""
    try:
        return str(json.loads(path.read_text())["torch"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _extension():
    """torch_steel._C_metal, or None where it is not built or cannot be used."""
    return _load_extension()[0]


def extension_problem() -> str | None:
    """Why an installed extension is not used (built for another torch, fails to import)."""
    return _load_extension()[1]


# The kernels need Metal 3.1 (bfloat): the metallib is built for macOS 14 and the runtime compiler
# is asked for MTLLanguageVersion3_1, which macOS 13 lacks (mps_src/mps/build_macos.py, library.mm).
MIN_MACOS = (14, 0)


def available() -> bool:
    """True when the Metal extension is built, an MPS device is usable and macOS can run the
    kernels (on macOS 13, where PyTorch's MPS works, the ops keep to reference math)."""
    return (
        _extension() is not None
        and torch.backends.mps.is_available()
        and torch.backends.mps.is_macos_or_newer(*MIN_MACOS)
    )


def refusal_reason(message: str) -> str | None:
    """The reason of a refused plan in an extension error message, or None for other errors.

    c10 errors may carry a C++ backtrace after the first line; the reason is one line.
    """
    at = message.find(REFUSED_PREFIX)
    if at < 0:
        return None
    return message[at + len(REFUSED_PREFIX) :].split("\n", 1)[0].strip()


def library_sources(package_dir: Path) -> tuple[Path | None, list[Path]]:
    """(the installed metallib or None, the installed MSL 3.1 shader sources)."""
    metallib = package_dir / METALLIB
    sources = sorted(
        p
        for p in (package_dir / SOURCE_DIR).glob("*.metal")
        if not p.name.endswith(TENSOR_OPS_SUFFIX)
    )
    return (metallib if metallib.is_file() else None), sources


def tensor_op_sources(package_dir: Path) -> tuple[Path | None, list[Path]]:
    """(the installed tensor-op metallib or None, the installed MSL 4 shader sources)."""
    metallib = package_dir / TENSOR_OPS_METALLIB
    sources = sorted((package_dir / SOURCE_DIR).glob("*" + TENSOR_OPS_SUFFIX))
    return (metallib if metallib.is_file() else None), sources


def _load_tensor_ops(ext, package_dir: Path) -> None:
    """The tensor-op kernels where the device and OS take them; silently absent otherwise."""
    metallib, sources = tensor_op_sources(package_dir)
    if metallib is not None and ext.load_tensor_ops_metallib(str(metallib)):
        return
    if sources:
        ext.compile_tensor_ops_sources([path.read_text() for path in sources])


def _load_library(ext) -> None:
    """Gives the extension its kernels, once per process (a failure is final too)."""
    global _load_failure
    with _load_lock:
        if _loaded:
            return
        if _load_failure is not None:
            raise RuntimeError(_load_failure)
        try:
            _load_library_locked(ext)
        except Exception as error:
            _load_failure = f"torch-steel: the Metal kernels are unavailable: {error}"
            raise


def _load_library_locked(ext) -> None:
    """_load_library's work, under its lock; raises when no library loads."""
    global _loaded
    package_dir = PACKAGE_DIR
    metallib, sources = library_sources(package_dir)
    why = "no precompiled metallib is installed (Xcode's Metal toolchain was missing)"
    if metallib is not None:
        try:
            ext.load_metallib(str(metallib))
            _load_tensor_ops(ext, package_dir)
            _loaded = True
            return
        except RuntimeError as error:  # e.g. built by a newer Xcode than this macOS runs
            if not sources:
                raise
            why = f"the installed metallib does not load ({error})"
    if not sources:
        raise RuntimeError(
            f"torch-steel: neither {METALLIB} nor {SOURCE_DIR}/*.metal is installed in "
            f"{package_dir}; reinstall torch-steel"
        )
    warnings.warn(
        f"torch-steel: {why}; compiling the shaders with the Metal runtime compiler now, "
        "once per process. Install Xcode and reinstall torch-steel to skip this.",
        stacklevel=4,
    )
    ext.compile_sources([path.read_text() for path in sources])
    _load_tensor_ops(ext, package_dir)
    _loaded = True


def run_op(
    op: str, tensors: Sequence[torch.Tensor | None], options: Mapping[str, Any] | None = None
) -> list[torch.Tensor]:
    """Runs `op`'s launch plan on MPS tensors; returns the plan's outputs.

    tensors: the op's tensor arguments in order, None for absent optionals; options: name ->
    number | bool | str. Raises PlanRefused when the plan refuses (the message names the limit).
    """
    ext = _extension()
    if ext is None:
        raise RuntimeError("torch-steel: the Metal extension is not built (it is built on macOS)")
    if not _loaded:  # else no lock to take: _loaded is set once, under it, and never unset
        _load_library(ext)
    try:
        return ext.run_op(op, tensors, options or {})
    except RuntimeError as error:
        reason = refusal_reason(str(error))
        if reason is None:
            raise
        raise PlanRefused(reason) from None
