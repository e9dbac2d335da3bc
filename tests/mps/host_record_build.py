"""Builds tests/mps/host_record.cpp (the Metal host path with a recording encoder) as a torch
extension, cached in the checkout's build/host_record, for tests/mps/test_host_record.py and
bench/bench_overhead.py."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def extension():
    """The built module, or None without a C++ compiler."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return None
    from torch.utils import cpp_extension

    build = ROOT / "build" / "host_record"
    build.mkdir(parents=True, exist_ok=True)
    sources = [ROOT / "tests" / "mps" / "host_record.cpp"]
    sources += sorted((ROOT / "mps_src" / "plan").glob("*.cpp"))
    return cpp_extension.load(
        name="steel_host_record",
        sources=[str(s) for s in sources],
        extra_include_paths=[str(ROOT / "mps_src"), str(ROOT / "shaders")],
        extra_cflags=["-O2"],
        build_directory=str(build),
        verbose=False,
    )
