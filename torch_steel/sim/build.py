"""Builds the CPU Metal simulator on first use (DESIGN.md section 4).

Four kinds of artifacts, each in a directory under the cache keyed by a hash of everything that
goes into it, so that a changed shader, shim header, translator or flag builds a new directory
and a library already loaded by another process (pytest-xdist) is never overwritten:

  rt-<hash>/libsteel_sim_rt.so    the runtime (mps_src/sim/*.cpp) and the planners
                                  (mps_src/plan/*.cpp), plain C++, no torch
  ext-<hash>/                     the pybind module (mps_src/sim/python/module.cpp) built with
                                  torch.utils.cpp_extension; links the runtime by soname
  lib-<hash>/lib/*.so            translated shaders (a mirror of shaders/ rewritten by
                                  torch_steel.sim.translate), one TU per .metal file, compiled
                                  with -fsanitize-coverage so every load and store reaches the
                                  checkers (mps_src/sim/shader/callbacks.cpp is linked in)
  test-<hash>/lib/*.so           the same for run_kernel's test-only .metal files

Shader libraries register their kernels with the runtime when dlopen'd, so the package's shaders
and any number of test libraries share one runtime and one pybind module. Builds take a file
lock, so concurrent processes wait for one build instead of racing.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from torch_steel.errors import SimulatorError

FRONT = Path(__file__).resolve().parent  # torch_steel/sim: the front end
PACKAGE = FRONT.parent
# A checkout (pip install -e .) has the native sources beside the package; a regular install
# carries a copy of them in the package (setup.py, NATIVE_SOURCES).
_CHECKOUT = PACKAGE.parent
IN_CHECKOUT = (_CHECKOUT / "shaders").is_dir() and (_CHECKOUT / "mps_src").is_dir()
ROOT = _CHECKOUT if IN_CHECKOUT else PACKAGE / "_native_src"
SIM_SRC = ROOT / "mps_src" / "sim"
PLAN_SRC = ROOT / "mps_src" / "plan"
SHIM = SIM_SRC / "shim"
SHADERS = ROOT / "shaders"

CXX = "clang++-19"
CC = "clang-19"
INSTALL_HINT = "apt-get install clang-19 libclang-rt-19-dev llvm-19"
# Host code: the runtime and the planners (portable C++17).
HOST_FLAGS = ["-std=c++17", "-O2", "-fPIC", "-Wall", "-Wextra", "-Wno-unused-parameter"]
if os.environ.get("TORCH_STEEL_SIM_UCONTEXT") == "1":  # the portable fiber switch, for testing
    HOST_FLAGS.append("-DSTEEL_SIM_UCONTEXT")
# Shader code: Metal semantics for half/bfloat (round after every operation), MSL attributes
# that C++ does not know, no exceptions (MSL has none; lanes run on fibers), and every load and
# store reported to the checkers (mps_src/sim/checkers.cpp).
SHADER_FLAGS = [
    # C++23: MSL copies structs between address spaces (`*(threadgroup S*)p = *(device S*)q`),
    # which clang accepts from C++23 on. MSL has no implicit vector conversions: neither here.
    "-std=c++23",
    "-flax-vector-conversions=none",
    "-O2",
    # Keep the shader's own accesses: merged neighbouring loads (SLP) or a loop vectorized into
    # 16-byte accesses would hide their alignment from the checkers (a misaligned vector access
    # is an error: mps_src/sim/checkers.cpp) and report accesses the kernel does not make.
    "-fno-slp-vectorize",
    "-fno-vectorize",
    # MSL has no variable-length arrays (clang accepts them as an extension).
    "-Werror=vla",
    "-fPIC",
    "-fno-exceptions",
    "-fno-rtti",
    # Each .metal file is its own library (_shader_lib): its functions are its own.
    "-fvisibility=hidden",
    "-fvisibility-inlines-hidden",
    "-ffp-contract=off",
    "-Xclang",
    "-ffloat16-excess-precision=none",
    "-Xclang",
    "-fbfloat16-excess-precision=none",
    "-Wno-unknown-attributes",
    "-fsanitize-coverage=func,trace-loads,trace-stores",
    # Frame pointers, and no sibling calls that would drop a frame: a barrier or simd operation
    # is identified by its whole call chain (mps_src/sim/runtime.cpp, call_chain).
    "-fno-omit-frame-pointer",
    "-mno-omit-leaf-frame-pointer",
    "-fno-optimize-sibling-calls",
    # A float -> int conversion out of range or of NaN is undefined in MSL: reported (the
    # handlers are in mps_src/sim/shader/callbacks.cpp).
    "-fsanitize=float-cast-overflow",
    "-fno-sanitize-recover=float-cast-overflow",
    # Indexing an array of known size (thread-private arrays, threadgroup arrays declared in
    # kernels, array members) out of bounds: reported (same handlers).
    "-fsanitize=array-bounds",
    "-fno-sanitize-recover=array-bounds",
    "-gline-tables-only",  # error messages name the shader line (torch_steel.sim symbolizes)
]
LINK_FLAGS = ["-shared", "-rtlib=compiler-rt"]
# Sources the Mac build compiles as MSL 4.0 (-std=metal4.0, mps_src/mps/build_macos.py): those
# named *_msl4.metal. The pre-pass preprocesses them so (__METAL_VERSION__ 400, tensors).
MSL4_SUFFIX = "_msl4.metal"


def is_msl4(path: Path) -> bool:
    return path.name.endswith(MSL4_SUFFIX)


def language(path: Path, std: str | None = None) -> str | None:
    """The -std a file is built with: `std` when given, else what the Mac build gives it
    (None: the pre-pass chooses from what the file uses)."""
    return std or ("metal4.0" if is_msl4(path) else None)


RUNTIME_SONAME = "libsteel_sim_rt.so"
LIBRARIES = "libraries.txt"  # a shader build's shared libraries, one per .metal file
BUILD_JOBS = "2"


def cache_root() -> Path:
    env = os.environ.get("TORCH_STEEL_SIM_CACHE")
    if env:
        return Path(env)
    if IN_CHECKOUT:
        return ROOT / "build" / "sim"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "torch_steel" / "sim"


def _clang() -> str | None:
    return shutil.which(CXX)


@functools.cache
def available() -> bool:
    """clang-19 is installed and the runtime, module and shader library build."""
    if _clang() is None:
        return False
    try:
        extension()
        shader_library()
    except SimulatorError:
        return False
    return True


def _files(root: Path, *patterns: str) -> list[Path]:
    out: list[Path] = []
    for pattern in patterns:
        out.extend(p for p in root.rglob(pattern) if p.is_file())
    return sorted(set(out))


def _digest(files: list[Path], *extra: object) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())  # how things are built is an input too
    for f in files:
        h.update(str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f).encode())
        h.update(b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    for e in extra:
        h.update(repr(e).encode())
    return h.hexdigest()[:16]


STALE_SECONDS = 7 * 24 * 3600
# Test libraries are many (tests write kernels to temporary files) and cheap to rebuild.
STALE_TEST_SECONDS = 24 * 3600


def _announce(what: str, usual: str, out: Path) -> None:
    """Says that a build starts, so that a first use is not silence (stderr)."""
    print(
        f"torch_steel: building the Metal simulator's {what} (first use after a change; usually "
        f"{usual}) in {out}",
        file=sys.stderr,
        flush=True,
    )


def _locked_build(out: Path, build, what: str = "", usual: str = "") -> Path:
    """Runs build(out) once per output directory across processes; `done` marks success."""
    out.parent.mkdir(parents=True, exist_ok=True)
    done = out / "done"
    if done.exists():
        done.touch()  # in use: keeps it from being collected as stale
        return out
    with open(out.parent / (out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not done.exists():
                if what:
                    _announce(what, usual, out)
                out.mkdir(exist_ok=True)
                build(out)
                done.write_text("ok\n")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _collect_stale(out)
    return out


def _collect_stale(fresh: Path) -> None:
    """After a new build, removes builds of the same kind unused for a week (test libraries: a
    day). A process that still has one loaded keeps its mapped files; a deleted directory is
    simply rebuilt."""
    kind = fresh.name.split("-")[0] + "-"
    limit = STALE_TEST_SECONDS if kind == "test-" else STALE_SECONDS
    now = time.time()
    for d in fresh.parent.glob(kind + "*"):
        done = d / "done"
        if d == fresh or not d.is_dir() or not done.exists():
            continue
        if now - done.stat().st_mtime > limit:
            shutil.rmtree(d, ignore_errors=True)
            (d.parent / (d.name + ".lock")).unlink(missing_ok=True)


def _ninja(out: Path, rules: str, builds: list[str], default: str) -> None:
    text = "\n".join([f"cxx = {CXX}", rules, *builds, f"default {default}", ""])
    (out / "build.ninja").write_text(text)
    proc = subprocess.run(
        ["ninja", "-C", str(out), "-j", BUILD_JOBS], check=False, capture_output=True, text=True
    )
    if proc.returncode != 0:
        log = (proc.stdout + proc.stderr)[-12000:]
        raise SimulatorError(f"simulator build failed in {out}:\n{log}{_hint(log)}")


def _hint(log: str) -> str:
    """The install hint, when a build log says the compiler runtime is missing."""
    if "clang_rt" in log or "compiler-rt" in log or "libclang_rt" in log:
        return f"\n(the compiler runtime is missing: {INSTALL_HINT})"
    return ""


def _q(p: Path | str) -> str:
    return str(p).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _require_clang() -> None:
    if _clang() is None:
        raise SimulatorError(f"the Metal simulator needs clang 19: {INSTALL_HINT}")


# ---------------------------------------------------------------------------------- runtime


def _runtime_inputs() -> list[Path]:
    return (
        _files(SIM_SRC, "*.cpp", "*.h") + _files(PLAN_SRC, "*.cpp", "*.h") + _files(SHADERS, "*.h")
    )


def _runtime_sources() -> list[Path]:
    return sorted(SIM_SRC.glob("*.cpp")) + sorted(PLAN_SRC.glob("*.cpp"))


@functools.cache
def runtime_dir() -> Path:
    _require_clang()
    files = [
        f
        for f in _runtime_inputs()
        if not f.is_relative_to(SHIM) and not f.is_relative_to(SIM_SRC / "python")
    ]
    out = cache_root() / f"rt-{_digest(files, HOST_FLAGS, LINK_FLAGS)}"

    def build(d: Path) -> None:
        flags = " ".join(HOST_FLAGS + ["-I", _q(ROOT / "mps_src"), "-I", _q(SHADERS)])
        rules = (
            f"rule cc\n  command = $cxx {flags} -MMD -MF $out.d -c $in -o $out\n"
            "  depfile = $out.d\n"
            f"rule link\n  command = $cxx {' '.join(LINK_FLAGS)} "
            f"-Wl,-soname,{RUNTIME_SONAME} $in -o $out -ldl -lpthread\n"
        )
        builds, objs = [], []
        for src in _runtime_sources():
            obj = f"obj/{src.parent.name}_{src.stem}.o"
            builds.append(f"build {obj}: cc {_q(src)}")
            objs.append(obj)
        builds.append(f"build {RUNTIME_SONAME}: link {' '.join(objs)}")
        _ninja(d, rules, builds, RUNTIME_SONAME)

    return _locked_build(out, build, "runtime", "10 s")


@functools.cache
def extension():
    """The pybind module (mps_src/sim/python/module.cpp), linked to the runtime."""
    rt = runtime_dir()
    # Loaded first and globally: the module and every shader library name the runtime by soname,
    # and the dynamic loader reuses this already-loaded copy for them.
    ctypes.CDLL(str(rt / RUNTIME_SONAME), mode=ctypes.RTLD_GLOBAL)
    module_src = SIM_SRC / "python" / "module.cpp"
    headers = _files(SIM_SRC, "*.h") + _files(PLAN_SRC, "*.h")
    import torch

    out = cache_root() / f"ext-{_digest([module_src, *headers], HOST_FLAGS, torch.__version__)}"
    out.mkdir(parents=True, exist_ok=True)
    from torch.utils import cpp_extension

    so, done = out / "steel_sim_ext.so", out / "done"
    if done.exists() and so.exists():
        # Built before: the directory's name digests every input, so the module is current.
        # Importing it skips cpp_extension.load's lock and ninja check, on which processes that
        # start at once (xdist workers, a fuzz campaign's rounds) otherwise queue for seconds.
        spec = importlib.util.spec_from_file_location("steel_sim_ext", so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if not so.exists():
        _announce("Python module", "30 s", out)
    old = {k: os.environ.get(k) for k in ("CXX", "CC")}
    os.environ["CXX"], os.environ["CC"] = CXX, CC
    try:
        module = cpp_extension.load(
            name="steel_sim_ext",
            sources=[str(module_src)],
            extra_cflags=["-O2", "-Wno-unused-parameter"],
            extra_include_paths=[str(ROOT / "mps_src"), str(SHADERS)],
            extra_ldflags=[f"-L{rt}", "-lsteel_sim_rt"],
            build_directory=str(out),
            verbose=False,
        )
        done.write_text("ok\n")  # after the load: the module is whole
        return module
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:  # has the compiler log
        raise SimulatorError(f"building the simulator module failed: {e}") from None
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------- shader libraries


def _translator():
    try:
        from torch_steel.sim.translate import translate
    except ImportError as e:
        raise SimulatorError(
            f"the shader pre-pass torch_steel.sim.translate is missing: {e}"
        ) from None
    return translate


def _mirror(
    src_root: Path,
    files: list[Path],
    mirror: Path,
    translate,
    include_dirs: list[Path],
    std: str | None = None,
) -> dict[Path, str]:
    """Translates the .metal `files` (each a translation unit: the pre-pass preprocesses it with
    its headers) into `mirror`; returns {file: error} for those the pre-pass refused.

    A refused file is mirrored as an `#error` carrying the message, so that it fails to build
    with the pre-pass's message.
    """
    errors = {}
    for f in files:
        dst = mirror / f.relative_to(src_root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            text = translate(f.read_text(), str(f), include_dirs, language(f, std))
        except Exception as e:  # noqa: BLE001 (any pre-pass failure must name the file)
            errors[f] = str(e)
            text = "#error " + json.dumps(f"pre-pass: {e}") + "\n"
        dst.write_text(text)
    return errors


@dataclasses.dataclass(frozen=True)
class ShaderLibrary:
    handle: object  # the module's Library
    errors: str  # why some .metal files are missing from it (empty when all built)


def _shader_lib(out: Path, metal_files: list[tuple[Path, Path]], strict: bool) -> str:
    """Compiles translated (original, mirrored) .metal files, one TU each, and links those that
    built into one shared library each (listed in libraries.txt). Returns the errors of the
    others (strict: raises them)."""
    rt = runtime_dir()
    flags = (
        " ".join(SHADER_FLAGS) + f" -I {_q(SHIM)} -I {_q(ROOT / 'mps_src')}"
        f" -include {_q(SIM_SRC / 'shader_prelude.h')}"
    )
    host = " ".join(HOST_FLAGS) + f" -I {_q(ROOT / 'mps_src')}"
    # Optimized IR, its memory intrinsics made visible to the checkers (sim/ir.py), then
    # machine code from that IR without optimizing it again.
    memops = f"{_q(sys.executable)} {_q(FRONT / 'ir.py')}"
    rules = (
        f"rule ll\n  command = $cxx -x c++ {flags} -S -emit-llvm $in -o $out 2> $log\n"
        f"rule memops\n  command = {memops} $in $out 2>> $log\n"
        f"rule cc\n  command = $cxx -fPIC -O2 -Xclang -disable-llvm-passes -c $in -o $out"
        " 2>> $log\n"
        # Unoptimized IR, for the recursion check (the optimizer may turn recursion into loops).
        f"rule ir\n  command = $cxx -x c++ {flags} -O0 -S -emit-llvm $in -o $out"
        " 2> $out.log\n"
        f"rule host\n  command = $cxx {host} -c $in -o $out 2> $out.log\n"
    )
    builds, objs = [], []
    for i, (_, mirrored) in enumerate(metal_files):
        obj = f"obj/{i}_{mirrored.stem}.o"
        log = f"  log = {obj}.log"
        builds.append(f"build {obj[:-2]}.opt.ll: ll {_q(mirrored)}\n{log}")
        builds.append(f"build {obj[:-2]}.mem.ll: memops {obj[:-2]}.opt.ll\n{log}")
        builds.append(f"build {obj}: cc {obj[:-2]}.mem.ll\n{log}")
        builds.append(f"build {obj[:-2]}.ll: ir {_q(mirrored)}")
        objs.append(obj)
    # The load/store callbacks, so that shader code calls them without the PLT; also what a
    # library with no kernels (none given, or none built) consists of.
    builds.append(f"build obj/callbacks.o: host {_q(SIM_SRC / 'shader' / 'callbacks.cpp')}")
    (out / "build.ninja").write_text("\n".join([f"cxx = {CXX}", rules, *builds, ""]))
    subprocess.run(
        ["ninja", "-C", str(out), "-j", BUILD_JOBS, "-k", "0"],
        check=False,
        capture_output=True,
        text=True,
    )
    errors = []
    for (original, _), obj in zip(metal_files, objs, strict=False):
        if not (out / obj).exists():
            log = (out / (obj + ".log")).read_text() if (out / (obj + ".log")).exists() else ""
            # Every error line first (a long log is cut), then the end of the log.
            summary = [line for line in log.splitlines() if ": error:" in line][:40]
            errors.append(f"{original}:\n" + "\n".join(summary) + f"\n...\n{log[-6000:]}")
            continue
        ir = out / (obj[:-2] + ".ll")
        cycles = recursion(ir.read_text()) if ir.exists() else []
        if cycles:
            (out / obj).unlink()  # left out of the library like a file that does not compile
            names = _demangle(sorted({name for cycle in cycles for name in cycle}))
            errors.append(
                f"{original}: recursion, which Metal does not allow: "
                + "; ".join(" -> ".join(names[n] for n in [*c, c[0]]) for c in cycles)
            )
    if not (out / "obj" / "callbacks.o").exists():
        raise SimulatorError(
            f"building {SIM_SRC / 'shader' / 'callbacks.cpp'} failed:\n"
            + (out / "obj" / "callbacks.o.log").read_text()
        )
    built = [obj for obj in objs if (out / obj).exists()]
    if errors and strict:
        raise SimulatorError("building shaders for the simulator failed:\n" + "\n".join(errors))
    # One shared library per .metal file, as Metal compiles each file on its own: an inline
    # helper of the same name in two files stays two functions (hidden symbols, bound within
    # their library). A library of the callbacks alone stands for "no kernels".
    libs = [f"lib/{Path(obj).stem}.so" for obj in built] or ["lib/empty.so"]
    (out / "lib").mkdir(exist_ok=True)
    for obj, lib in zip(built or [None], libs, strict=True):
        inputs = ([obj] if obj else []) + ["obj/callbacks.o"]
        link = subprocess.run(
            [CXX, *LINK_FLAGS, "-Wl,-Bsymbolic", *inputs, "-o", lib, f"-L{rt}", "-lsteel_sim_rt"],
            cwd=out,
            check=False,
            capture_output=True,
            text=True,
        )
        if link.returncode != 0:
            raise SimulatorError(
                f"linking shaders for the simulator failed:\n{link.stderr[-6000:]}"
                + _hint(link.stderr)
            )
    (out / LIBRARIES).write_text("\n".join(libs) + "\n")
    (out / "errors.txt").write_text("\n".join(errors))
    return "\n".join(errors)


_IR_NAME = r'@("(?:[^"\\]|\\.)*"|[-\w$.]+)'
_IR_DEFINE = re.compile(r"^define [^@]*" + _IR_NAME)
_IR_CALL = re.compile(r"\b(?:call|invoke)\b[^@]*" + _IR_NAME)


def recursion(ir: str) -> list[list[str]]:
    """The call cycles among the functions an LLVM IR module defines (MSL has no recursion): each
    a list of mangled names, a function calling itself as a list of one."""
    calls: dict[str, set[str]] = {}
    current = None
    for line in ir.splitlines():
        if current is None:
            m = _IR_DEFINE.match(line)
            if m:
                current = calls.setdefault(m.group(1), set())
        elif line.startswith("}"):
            current = None
        else:
            current.update(_IR_CALL.findall(line))
    # Tarjan's strongly connected components, iteratively (shader TUs define ~1000 functions).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in calls:
        if root in index:
            continue
        work = [(root, iter(sorted(calls[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, callees = work[-1]
            for callee in callees:
                if callee not in calls:
                    continue  # declared only: the runtime, libm
                if callee not in index:
                    index[callee] = low[callee] = len(index)
                    stack.append(callee)
                    on_stack.add(callee)
                    work.append((callee, iter(sorted(calls[callee]))))
                    break
                if callee in on_stack:
                    low[node] = min(low[node], index[callee])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in calls[node]:
                        cycles.append(component[::-1])
    return cycles


def _demangle(names: list[str]) -> dict[str, str]:
    plain = [n.strip('"') for n in names]
    tool = shutil.which("c++filt")
    if tool is None:
        return dict(zip(names, plain, strict=True))
    done = subprocess.run([tool], input="\n".join(plain), capture_output=True, text=True)
    lines = done.stdout.splitlines()
    return dict(zip(names, lines if len(lines) == len(names) else plain, strict=True))


def _load(lib_dir: Path) -> ShaderLibrary:
    ext = extension()
    try:
        paths = (lib_dir / LIBRARIES).read_text().split()
        handle = ext.load_library([str(lib_dir / p) for p in paths])
    except ext.SimError as e:
        raise SimulatorError(str(e)) from None
    errors = lib_dir / "errors.txt"
    return ShaderLibrary(handle, errors.read_text() if errors.exists() else "")


def _lang_inputs() -> list[Path]:
    helpers = [FRONT / "translate.py", FRONT / "ir.py"]
    return _files(SHIM, "*") + [h for h in helpers if h.exists()]


@functools.cache
def shader_library() -> ShaderLibrary:
    """The package's shaders (every .metal under shaders/), loaded. A .metal file that does not
    build is left out (its errors are in .errors and in "kernel not found" messages), so one
    broken kernel does not take the others down."""
    translate = _translator()
    rt = runtime_dir()
    shader_files = _files(SHADERS, "*.metal", "*.h")
    out = cache_root() / f"lib-{_digest(shader_files + _lang_inputs(), SHADER_FLAGS, rt.name)}"

    def build(d: Path) -> None:
        mirror = d / "src"
        metal_files = [f for f in shader_files if f.suffix == ".metal"]
        _mirror(SHADERS, metal_files, mirror, translate, [SHADERS])
        metals = [(f, mirror / f.relative_to(SHADERS)) for f in metal_files]
        _shader_lib(d, metals, strict=False)

    return _load(_locked_build(out, build, "shaders", "20-40 s"))


_test_libraries: dict[str, ShaderLibrary] = {}


def test_library(
    sources: list[Path], include_dirs: list[Path] = (), std: str | None = None
) -> ShaderLibrary:
    """A library of test-only kernels: the given .metal files (which may include headers next
    to them, headers under `include_dirs` and the package's shaders/ headers), loaded. Any
    build error is raised."""
    translate = _translator()
    rt = runtime_dir()
    sources = [s.resolve() for s in sources]
    for s in sources:
        if not s.is_file():
            raise FileNotFoundError(f"kernel source {s} not found")
    include_dirs = [Path(d).resolve() for d in include_dirs]
    for d in include_dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"include directory {d} not found")
    dirs = sorted({s.parent for s in sources})
    # What a source may #include: headers, and .metal files too (llama.cpp's fa_f16.metal
    # includes fa_common.metal), so that an edit of either rebuilds.
    local_headers = sorted({h for d in dirs for p in ("*.h", "*.metal") for h in d.glob(p)})
    included = [_files(d, "*.h", "*.metal") for d in include_dirs]
    shader_headers = _files(SHADERS, "*.h")
    key = _digest(
        sources
        + local_headers
        + [h for hs in included for h in hs]
        + shader_headers
        + _lang_inputs(),
        SHADER_FLAGS,
        rt.name,
        [str(d) for d in include_dirs],
        std,
    )
    if key in _test_libraries:
        return _test_libraries[key]
    out = cache_root() / f"test-{key}"

    def build(d: Path) -> None:
        metals = []
        for i, dd in enumerate(dirs):
            mirror = d / f"src{i}"
            mine = [s for s in sources if s.parent == dd]
            errors = _mirror(dd, mine, mirror, translate, [*include_dirs, SHADERS], std)
            bad = [f"{f}: {e}" for f, e in errors.items()]
            if bad:
                raise SimulatorError("the shader pre-pass refused:\n" + "\n".join(bad))
            metals += [(s, mirror / s.name) for s in mine]
        _shader_lib(d, metals, strict=True)

    names = ", ".join(s.name for s in sources)
    lib = _load(_locked_build(out, build, f"test kernels ({names})", "5-20 s"))
    _test_libraries[key] = lib
    return lib


if __name__ == "__main__":  # python -m torch_steel.sim.build: build everything, print where
    print(runtime_dir(), file=sys.stderr)
    extension()
    shader_library()
    print("simulator built under", cache_root())
