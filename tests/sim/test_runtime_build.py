"""The simulator's on-demand build: one build per input hash across processes, clear errors."""

import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel.errors import SimulatorError
from torch_steel.sim import build

ROOT = Path(__file__).resolve().parents[2]


needs_sim = requires_clang


def _slow_build(out: Path) -> None:
    with open(out.parent / "log", "a") as log:
        log.write("build\n")
    time.sleep(0.5)
    (out / "artifact").write_text("x")


def _build_in_process(out: str) -> None:
    build._locked_build(Path(out), _slow_build)


def test_concurrent_builds_of_one_directory_run_once(tmp_path):
    out = tmp_path / "lib-abc"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_build_in_process, args=(str(out),)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert (tmp_path / "log").read_text() == "build\n"
    assert (out / "artifact").exists() and (out / "done").exists()


def test_failed_build_is_retried(tmp_path):
    out = tmp_path / "lib-def"

    def broken(d: Path) -> None:
        raise SimulatorError("compiler said no")

    with pytest.raises(SimulatorError, match="compiler said no"):
        build._locked_build(out, broken)
    assert not (out / "done").exists()
    build._locked_build(out, _slow_build)
    assert (out / "done").exists()


@needs_sim
def test_compile_error_in_a_test_kernel_is_reported(tmp_path):
    from torch_steel import sim

    src = tmp_path / "exec_broken.metal"
    src.write_text(
        "#include <metal_stdlib>\nusing namespace metal;\n"
        "kernel void exec_broken(device float* out [[buffer(0)]]) {\n"
        "  out[0] = undeclared_name;\n}\n"
    )
    with pytest.raises(SimulatorError, match=r"exec_broken.metal.*undeclared_name"):
        sim.run_kernel(
            "exec_broken", sources=[src], grid=(1,), threads=(1,), buffers={0: torch.zeros(1)}
        )


_RECURSIVE = {
    "direct": "uint fact(uint n) { return n <= 1 ? 1 : n * fact(n - 1); }\n",
    "mutual": (
        "bool odd(uint n);\n"
        "bool even(uint n) { return n == 0 ? true : odd(n - 1); }\n"
        "bool odd(uint n) { return n == 0 ? false : even(n - 1); }\n"
        "uint fact(uint n) { return even(n) ? 1 : 0; }\n"
    ),
}


@needs_sim
@pytest.mark.parametrize("kind", sorted(_RECURSIVE))
def test_recursion_is_refused(tmp_path, kind):
    # MSL has no recursion: a kernel that recurses must not build, whatever the optimizer would
    # make of it (the check reads unoptimized IR).
    from torch_steel import sim

    src = tmp_path / f"lang_recursive_{kind}.metal"
    src.write_text(
        "#include <metal_stdlib>\nusing namespace metal;\n"
        + _RECURSIVE[kind]
        + "kernel void lang_recursive(device uint* out [[buffer(0)]]) { out[0] = fact(out[0]); }\n"
    )
    cycle = "fact(unsigned int) -> fact" if kind == "direct" else "even(unsigned int) -> odd"
    match = "recursion, which Metal does not allow: .*" + re.escape(cycle)
    with pytest.raises(SimulatorError, match=match):
        sim.run_kernel(
            "lang_recursive", sources=[src], grid=(1,), threads=(1,), buffers={0: torch.ones(1)}
        )


@needs_sim
def test_missing_source_file():
    from torch_steel import sim

    with pytest.raises(FileNotFoundError):
        sim.run_kernel(
            "x", sources=["/nonexistent/exec_x.metal"], grid=(1,), threads=(1,), buffers={}
        )


@needs_sim
@pytest.mark.slow
def test_portable_ucontext_fibers(tmp_path):
    # The fallback for other architectures, built here with -DSTEEL_SIM_UCONTEXT into a fresh
    # cache, must pass the runtime and checker tests too.
    import subprocess
    import sys

    env = dict(os.environ, TORCH_STEEL_SIM_UCONTEXT="1", TORCH_STEEL_SIM_CACHE=str(tmp_path))
    tests = [str(ROOT / "tests" / "sim" / f) for f in ("test_runtime.py", "test_checkers.py")]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_builds_unused_for_a_week_are_collected(tmp_path):
    old, recent = tmp_path / "test-old", tmp_path / "test-recent"
    for d in (old, recent):
        d.mkdir()
        (d / "done").write_text("ok\n")
    week = build.STALE_SECONDS + 60
    os.utime(old / "done", (time.time() - week, time.time() - week))
    build._locked_build(tmp_path / "test-new", _slow_build)
    assert not old.exists()
    assert recent.exists() and (tmp_path / "test-new" / "done").exists()


@pytest.mark.slow
def test_regular_install_builds_outside_a_checkout(tmp_path):
    # `pip install .` (not -e) carries the simulator's sources in torch_steel/_native_src: the
    # simulator must build from there, with its cache outside the package.
    import subprocess
    import sys

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    script = (
        "import torch\n"
        "from torch_steel import sim\n"
        "from torch_steel.sim import build\n"
        "assert not build.IN_CHECKOUT, build.ROOT\n"
        "a, b = torch.randn(33, 17), torch.randn(17, 9)\n"
        "(out,) = sim.run_op('gemm', [a, b, None, None], {'beta': 0.0})\n"
        "print(float((out - a @ b).abs().max()))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(target), XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("TORCH_STEEL_SIM_CACHE", None)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert float(proc.stdout) < 1e-5  # float32, K = 17: a few ulps of the largest sum
    assert (tmp_path / "cache" / "torch_steel" / "sim").is_dir()


def test_each_metal_file_keeps_its_own_helpers():
    from torch_steel import sim

    kernels = Path(__file__).parent / "kernels"
    sources = [kernels / "lang_file_a.metal", kernels / "lang_file_b.metal"]
    a = torch.zeros(4)
    b = torch.zeros(4)
    sim.run_kernel("lang_file_a", sources=sources, grid=(1,), threads=(4,), buffers={0: a})
    sim.run_kernel("lang_file_b", sources=sources, grid=(1,), threads=(4,), buffers={0: b})
    assert a.tolist() == [i + 1.0 + 200.0 for i in range(4)]
    assert b.tolist() == [i * 10.0 + 1000.0 for i in range(4)]


@requires_clang
def test_a_build_says_what_it_builds_as_it_starts(tmp_path, capfd):
    # A first use is a build of several seconds: it must not be silence. A comment naming the
    # temporary directory makes the source, and so its build directory, new.
    from torch_steel import sim

    src = tmp_path / "announced.metal"
    src.write_text(
        f"// {tmp_path}\n"
        "#include <metal_stdlib>\n"
        "using namespace metal;\n"
        "kernel void announced(device float* out [[buffer(0)]],\n"
        "                      uint i [[thread_position_in_grid]]) { out[i] = float(i); }\n"
    )
    out = torch.zeros(4)
    sim.run_kernel("announced", sources=[src], grid=(1,), threads=(4,), buffers={0: out})
    err = capfd.readouterr().err
    assert re.search(
        r"building the Metal simulator's test kernels \(announced\.metal\) \(first use after a "
        r"change; usually [^)]+\) in \S+",
        err,
    ), err
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    sim.run_kernel("announced", sources=[src], grid=(1,), threads=(4,), buffers={0: out})
    assert "building" not in capfd.readouterr().err  # built once, then silent


@needs_sim
def test_a_built_module_is_imported_without_cpp_extension():
    """Once the module's directory is marked done, a new process imports it directly: no
    cpp_extension.load (its lock and ninja check), whose queue made processes that start at once
    wait seconds. The directory's name digests the inputs, so what is imported is current."""
    build.extension()  # built (and marked) here if it was not yet
    code = (
        "import torch.utils.cpp_extension as ce\n"
        "def refuse(*a, **k):\n"
        "    raise AssertionError('cpp_extension.load called')\n"
        "ce.load = refuse\n"
        "from torch_steel.sim import build\n"
        "m = build.extension()\n"
        "print(m.__name__, hasattr(m, 'run_plan'))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["steel_sim_ext", "True"]
