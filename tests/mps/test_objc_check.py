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


# One mistake each that the check must catch: (file, original text, mutated text, error).
_MUTANTS = {
    "misspelled_selector": (
        "module.mm",
        "[encoder_ setBuffer:",
        "[encoder_ setBufer:",
        "'setBufer:offset:atIndex:' not found",
    ),
    # Pipelines come from the device; an MTLFunction has no such method.
    "selector_of_another_protocol": (
        "library.mm",
        "[device() newComputePipelineStateWithFunction:",
        "[function newComputePipelineStateWithFunction:",
        "no known instance method for selector 'newComputePipelineStateWithFunction:error:'",
    ),
    # newLibraryWithURL: takes an NSURL, not a path string.
    "wrong_argument_type": (
        "library.mm",
        "newLibraryWithURL:[NSURL fileURLWithPath:to_ns(path)]",
        "newLibraryWithURL:to_ns(path)",
        "cannot initialize a parameter of type 'NSURL *",
    ),
    # The tensor's storage pointer is the MTLBuffer (as in PyTorch's getMTLBufferStorage); under
    # ARC (what setup.py builds with) turning it into an object pointer must say who owns it.
    "arc_unbridged_cast": (
        "module.mm",
        "(__bridge id<MTLBuffer>)(tensor.storage().data())",
        "(id<MTLBuffer>)(tensor.storage().data())",
        "requires a bridged cast",
    ),
    # Apple's headers are NS_ASSUME_NONNULL; the subset keeps that, so nil where Metal requires
    # an object is caught (-Wnonnull under -Werror).
    "nil_for_a_nonnull_argument": (
        "module.mm",
        "[encoder_ setComputePipelineState:pipelines_.at(next_pipeline_++)];",
        "[encoder_ setComputePipelineState:nil];",
        "null passed to a callee that requires a non-null argument",
    ),
}


@pytest.mark.parametrize("mutant", sorted(_MUTANTS))
def test_mistake_fails_the_check(tmp_path, mutant):
    name, old, new, error = _MUTANTS[mutant]
    result = _check(_mutant(tmp_path, name, old, new))
    assert result.returncode != 0
    assert error in result.stderr, result.stderr


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


# ---- nothing unwinds out of a block on the MPS stream's queue --------------------------------
#
# A C++ exception (TORCH_CHECK, std::vector::at, ...) leaving a block that libdispatch runs has no
# handler to reach: the process terminates. PyTorch's own kernels wrap such blocks
# (dispatch_sync_with_rethrow, which is not exported for extensions); module.mm catches
# everything inside the block and raises afterwards. This holds every dispatch block to that.


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _closing(text: str, open_at: int) -> int:
    """Index of the brace closing the one at open_at (no braces in strings here)."""
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise AssertionError("unbalanced braces")


def unguarded_dispatch_blocks(text: str) -> list[str]:
    """The dispatch_sync / dispatch_async blocks whose whole body is not try { } catch (...) { },
    optionally inside one @autoreleasepool."""
    text = _strip_comments(text)
    problems = []
    for call in re.finditer(r"\bdispatch_(?:a?sync)\s*\(", text):
        caret = text.index("^", call.end())
        start = text.index("{", caret)
        body = text[start + 1 : _closing(text, start)].strip()
        pool = re.match(r"@autoreleasepool\s*\{", body)
        if pool:
            inner_end = _closing(body, pool.end() - 1)
            if body[inner_end + 1 :].strip():
                problems.append(f"offset {call.start()}: statements after the autorelease pool")
                continue
            body = body[pool.end() : inner_end].strip()
        guarded = re.match(r"try\s*\{", body)
        if not guarded:
            problems.append(f"offset {call.start()}: the block does not start with try")
            continue
        rest = body[_closing(body, guarded.end() - 1) + 1 :]
        last_catch = None
        while clause := re.match(r"\s*catch\s*\(([^)]*)\)\s*\{", rest):
            last_catch = clause.group(1).strip()
            rest = rest[_closing(rest, clause.end() - 1) + 1 :]
        if last_catch != "...":
            problems.append(f"offset {call.start()}: the last handler is not catch (...)")
        elif rest.strip():
            problems.append(f"offset {call.start()}: statements after the handlers")
    return problems


def test_dispatch_blocks_catch_everything():
    checked = 0
    for source in SOURCES:
        text = source.read_text()
        assert not unguarded_dispatch_blocks(text), source.name
        checked += len(re.findall(r"\bdispatch_a?sync\s*\(", _strip_comments(text)))
    assert checked >= 1  # module.mm encodes on the stream's queue


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("      } catch (...) {\n", "      } catch (const c10::Error&) {\n", "not catch (...)"),
        (
            "    @autoreleasepool {\n      try {\n",
            "    @autoreleasepool {\n      {\n",
            "start with try",
        ),
        (
            "  dispatch_sync(stream->queue(), ^{\n",
            '  dispatch_sync(stream->queue(), ^{\n    TORCH_CHECK(stream, "x");\n',
            "start with try",
        ),
        (
            "    }\n  });\n",
            '    }\n    TORCH_CHECK(stream, "x");\n  });\n',
            "after the autorelease",
        ),
    ],
    ids=["narrow_handler", "no_try", "check_before", "check_after"],
)
def test_an_unguarded_dispatch_block_is_reported(old, new, problem):
    text = (MPS_DIR / "module.mm").read_text()
    assert text.count(old) == 1, old
    problems = unguarded_dispatch_blocks(text.replace(old, new))
    assert len(problems) == 1 and problem in problems[0], problems
