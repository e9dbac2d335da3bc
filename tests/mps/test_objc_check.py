"""The Objective-C++ host type-checks against the real torch headers and Apple's API.

Nothing here can run Metal, so CI compiles every mps_src/mps/*.mm with clang-19 in Objective-C++
mode, syntax and types only, against torch's own headers (ATen/mps/MPSStream.h and the rest) and
mps_src/mps/check/apple_sdk_subset.h, the Metal / Foundation / MPS / dispatch declarations the
files use, as Apple declares them. A misspelled selector, a wrong argument type or a misuse of
torch's C++ API fails here.
"""

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPS_DIR = ROOT / "mps_src" / "mps"
CLANG = shutil.which("clang++-19")

pytestmark = pytest.mark.skipif(CLANG is None, reason="clang++-19 is not installed")


def _command(source: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    system = [*include_paths(), sysconfig.get_paths()["include"]]
    return [
        CLANG,
        "-x",
        "objective-c++",
        "-fsyntax-only",
        "-fblocks",
        "-std=c++20",
        # What setup.py builds with (ARC), for the Objective-C runtime of macOS.
        "-fobjc-arc",
        "-fobjc-runtime=macosx-14.0",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-Werror=objc-method-access",
        "-I",
        str(MPS_DIR / "check" / "include"),
        "-I",
        str(ROOT / "mps_src"),
        "-I",
        str(ROOT / "shaders"),
        *[arg for path in system for arg in ("-isystem", path)],
        "-DTORCH_EXTENSION_NAME=_C_metal",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        str(source),
    ]


def _check(source: Path) -> subprocess.CompletedProcess:
    return subprocess.run(_command(source), capture_output=True, text=True, timeout=300)


SOURCES = sorted(MPS_DIR.glob("*.mm"))


def test_there_are_sources_to_check():
    assert {p.name for p in SOURCES} >= {"library.mm", "module.mm"}


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_objective_cpp_compiles(source):
    result = _check(source)
    assert result.returncode == 0, result.stderr


def _mutant(tmp_path: Path, name: str, old: str, new: str) -> Path:
    """A copy of mps_src/mps/<name> with one change, checked from its own directory."""
    text = (MPS_DIR / name).read_text()
    assert text.count(old) == 1, f"{old!r} should occur once in {name}"
    path = tmp_path / name
    path.write_text(text.replace(old, new))
    return path


def test_misspelled_selector_fails(tmp_path):
    result = _check(_mutant(tmp_path, "module.mm", "[encoder_ setBuffer:", "[encoder_ setBufer:"))
    assert result.returncode != 0
    assert "'setBufer:offset:atIndex:' not found" in result.stderr, result.stderr


def test_selector_of_another_protocol_fails(tmp_path):
    # Pipelines come from the device; an MTLFunction has no such method.
    result = _check(
        _mutant(
            tmp_path,
            "library.mm",
            "[device() newComputePipelineStateWithFunction:",
            "[function newComputePipelineStateWithFunction:",
        )
    )
    assert result.returncode != 0
    assert (
        "no known instance method for selector 'newComputePipelineStateWithFunction:error:'"
        in result.stderr
    ), result.stderr


def test_wrong_argument_type_fails(tmp_path):
    # newLibraryWithURL: takes an NSURL, not a path string.
    result = _check(
        _mutant(
            tmp_path,
            "library.mm",
            "newLibraryWithURL:[NSURL fileURLWithPath:to_ns(path)]",
            "newLibraryWithURL:to_ns(path)",
        )
    )
    assert result.returncode != 0
    assert "cannot initialize a parameter of type 'NSURL *" in result.stderr, result.stderr


def test_the_sdk_subset_declares_only_what_is_used():
    """Every method and property of apple_sdk_subset.h is used by a .mm file or torch's headers."""
    from torch.utils.cpp_extension import include_paths

    subset = (MPS_DIR / "check" / "apple_sdk_subset.h").read_text()
    declared = re.findall(r"^[-+] \([^)]*\)\s*(\w+)", subset, re.M)
    declared += re.findall(r"^@property\([^)]*\) [^;]*?(\w+);", subset, re.M)
    assert len(declared) >= 15
    torch_include = Path(include_paths()[0])
    users = [p.read_text() for p in SOURCES]
    users += [p.read_text() for p in (torch_include / "ATen" / "mps").glob("*.h")]
    used = "\n".join(users)
    unused = [name for name in declared if not re.search(rf"\b{name}\b", used)]
    assert not unused
