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

needs_clang = pytest.mark.skipif(CLANG is None, reason="clang++-19 is not installed")


def _deployment_target() -> str:
    text = (MPS_DIR / "build_macos.py").read_text()
    return re.search(r'^DEPLOYMENT_TARGET = "([\d.]+)"$', text, re.M).group(1)


DEPLOYMENT_TARGET = _deployment_target()


# ---- availability: Apple's API_AVAILABLE / API_DEPRECATED, judged against a deployment target ----
#
# clang checks availability attributes only for an Apple target, and an Apple target cannot use
# this machine's C and C++ headers. So the check rewrites the SDK subset's annotations for the
# deployment target first: an API introduced later becomes `unavailable` (an error on use, where
# the Mac's clang says -Wunguarded-availability-new), one deprecated by then `deprecated` (an
# error under -Werror, as -Wdeprecated-declarations), and the rest nothing. (@available guards
# are not modelled: the host uses none.)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _macos_versions(arguments: str) -> list[str]:
    found = re.search(r"\bmacos\(\s*(\d+(?:\.\d+)*)\s*(?:,\s*(\d+(?:\.\d+)*)\s*)?\)", arguments)
    return [v for v in found.groups() if v] if found else []


def for_deployment_target(header: str, target: str) -> str:
    """header with each API_AVAILABLE(...) / API_DEPRECATED(...) replaced as described above."""
    out, at = [], 0
    pattern = re.compile(r"\bAPI_(AVAILABLE|DEPRECATED)\(")
    while found := pattern.search(header, at):
        line_start = header.rfind("\n", 0, found.start()) + 1
        if header[line_start : found.start()].lstrip().startswith("#"):
            out.append(header[at : found.end()])  # the fallback #defines themselves
            at = found.end()
            continue
        depth, end = 0, found.end() - 1
        for end in range(found.end() - 1, len(header)):
            depth += {"(": 1, ")": -1}.get(header[end], 0)
            if depth == 0:
                break
        arguments = header[found.end() : end]
        versions = _macos_versions(arguments)
        replacement = ""
        if found.group(1) == "AVAILABLE" and versions:
            if _version(versions[0]) > _version(target):
                replacement = (
                    f'__attribute__((unavailable("introduced in macOS {versions[0]}, after the '
                    f'deployment target macOS {target}")))'
                )
        elif found.group(1) == "DEPRECATED" and len(versions) == 2:
            if _version(versions[1]) <= _version(target):
                message = re.match(r'\s*"([^"]*)"', arguments)
                replacement = (
                    f'__attribute__((deprecated("deprecated in macOS {versions[1]}: '
                    f'{message.group(1) if message else ""}")))'
                )
        out.append(header[at : found.start()] + replacement)
        at = end + 1
    out.append(header[at:])
    return "".join(out)


def _sdk_for(target: str) -> Path:
    """A copy of mps_src/mps/check/ whose subset is rewritten for `target` (cached per target)."""
    import tempfile

    if target not in _SDK_DIRS:
        copy = Path(tempfile.mkdtemp(prefix=f"steel-sdk-{target}-")) / "check"
        shutil.copytree(MPS_DIR / "check", copy)
        subset = copy / "apple_sdk_subset.h"
        subset.write_text(for_deployment_target(subset.read_text(), target))
        _SDK_DIRS[target] = copy
    return _SDK_DIRS[target]


_SDK_DIRS: dict[str, Path] = {}


def _command(source: Path, target: str = DEPLOYMENT_TARGET) -> list[str]:
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
        str(_sdk_for(target) / "include"),
        "-I",
        str(ROOT / "mps_src"),
        "-I",
        str(ROOT / "shaders"),
        *[arg for path in system for arg in ("-isystem", path)],
        "-DTORCH_EXTENSION_NAME=_C_metal",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        str(source),
    ]


def _check(source: Path, target: str = DEPLOYMENT_TARGET) -> subprocess.CompletedProcess:
    return subprocess.run(_command(source, target), capture_output=True, text=True, timeout=300)


SOURCES = sorted(MPS_DIR.glob("*.mm"))


def test_there_are_sources_to_check():
    assert {p.name for p in SOURCES} >= {"library.mm", "module.mm"}


@needs_clang
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
    # The registry property is a CFTypeRef: reading it as a number takes a CFNumberRef, as
    # Apple declares CFNumberGetValue.
    "cf_property_not_a_number": (
        "library.mm",
        "CFNumberGetValue(static_cast<CFNumberRef>(property),",
        "CFNumberGetValue(property,",
        "no matching function for call to 'CFNumberGetValue'",
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


@needs_clang
@pytest.mark.parametrize("mutant", sorted(_MUTANTS))
def test_mistake_fails_the_check(tmp_path, mutant):
    name, old, new, error = _MUTANTS[mutant]
    result = _check(_mutant(tmp_path, name, old, new))
    assert result.returncode != 0
    assert error in result.stderr, result.stderr


def test_for_deployment_target_rewrites_the_annotations():
    header = (
        "#define API_AVAILABLE(...)\n"
        "@property BOOL a API_AVAILABLE(macos(10.13), ios(11.0));\n"
        "@property BOOL b API_AVAILABLE(macos(15.0), ios(18.0));\n"
        '@property BOOL c API_DEPRECATED("Use b", macos(10.11, 15.0), ios(8.0, 18.0));\n'
        "@property BOOL d API_AVAILABLE(ios(18.0));\n"
    )
    assert for_deployment_target(header, "14.0").splitlines() == [
        "#define API_AVAILABLE(...)",
        "@property BOOL a ;",
        '@property BOOL b __attribute__((unavailable("introduced in macOS 15.0, after the '
        'deployment target macOS 14.0")));',
        "@property BOOL c ;",
        "@property BOOL d ;",  # not a macOS API: not this check's business
    ]
    at_15 = for_deployment_target(header, "15.0").splitlines()
    assert at_15[2] == "@property BOOL b ;"
    assert (
        at_15[3]
        == '@property BOOL c __attribute__((deprecated("deprecated in macOS 15.0: Use b")));'
    )


def test_every_metal_declaration_has_its_availability():
    """Each Metal protocol, class, enum and each method or property newer than Metal itself
    (macOS 10.11) says when it arrived, so that the check can see a newer one."""
    subset = (MPS_DIR / "check" / "apple_sdk_subset.h").read_text()
    metal = subset[subset.index("// ---- Metal") : subset.index("// ---- MetalPerformanceShaders")]
    for found in re.finditer(r"^(@protocol|@interface) (MTL\w+)\b(?! *;)", metal, re.M):
        before = metal[: found.start()].rstrip().splitlines()[-1]
        assert before.startswith("API_AVAILABLE(macos("), found.group(2)
    assert len(re.findall(r"API_AVAILABLE\(macos\(", metal)) >= 20


@needs_clang
def test_an_api_newer_than_the_deployment_target_fails_the_check(tmp_path):
    """MTLCompileOptions.mathMode arrived in macOS 15, after the deployment target."""
    assert _version(DEPLOYMENT_TARGET) < (15,)
    source = _mutant(
        tmp_path,
        "library.mm",
        "options.fastMathEnabled = NO;",
        "options.mathMode = MTLMathModeSafe;",
    )
    result = _check(source)
    assert result.returncode != 0
    assert "'mathMode' is unavailable: introduced in macOS 15.0" in result.stderr, result.stderr


@needs_clang
def test_the_check_follows_the_deployment_target():
    """With macOS 15 as the target, the host's fastMathEnabled (deprecated there) fails instead."""
    result = _check(MPS_DIR / "library.mm", target="15.0")
    assert result.returncode != 0
    assert "'fastMathEnabled' is deprecated: deprecated in macOS 15.0" in result.stderr, (
        result.stderr
    )


def test_the_deployment_target_reaches_compile_and_link():
    """The minimum macOS goes to the Metal compiler, the extension's compile and its link (which
    records it in the binary); before, the link used the toolchain's default. The MSL 4
    tensor-op metallib has its own (macOS 26.2), set once too."""
    text = (MPS_DIR / "build_macos.py").read_text()
    main = 'MIN_VERSION_FLAG = f"-mmacosx-version-min={DEPLOYMENT_TARGET}"'
    tensor_ops = 'TENSOR_OPS_MIN_VERSION_FLAG = "-mmacosx-version-min=26.2"'
    assert main in text and tensor_ops in text
    assert "-mmacosx-version-min=" not in text.replace(main, "").replace(tensor_ops, "")


def test_the_sdk_subset_declares_only_what_is_used():
    """Every method and property of apple_sdk_subset.h is used by a .mm file or torch's headers."""
    from torch.utils.cpp_extension import include_paths

    subset = for_deployment_target((MPS_DIR / "check" / "apple_sdk_subset.h").read_text(), "99")
    subset = re.sub(r'\s*__attribute__\(\((?:unavailable|deprecated)\("[^"]*"\)\)\)', "", subset)
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


# ---- the GIL: released around planning (pipeline compilation) and the MPS queue ----------------
#
# run_op converts its Python arguments, releases the GIL (pybind11::gil_scoped_release, as
# PyTorch's own bindings do around an op) and calls run_plan, which must touch no Python object:
# everything it reaches is C++ and Metal. Holding the GIL there froze every Python thread while a
# pipeline compiled, and could deadlock with a thread that holds the stream's queue.


def _function_spans(text: str) -> dict[str, tuple[int, int]]:
    """name -> (start, end) of each top-level-looking function definition's body in text."""
    spans = {}
    for found in re.finditer(r"^[\w:<>,* &]+?\b(\w+)\(([^;{]*?)\)\s*(?:const\s*)?\{", text, re.M):
        spans.setdefault(found.group(1), (found.start(), _closing(text, found.end() - 1)))
    for found in re.finditer(r"^class (\w+)\b[^;{]*\{", text, re.M):  # a class's whole body
        spans.setdefault(found.group(1), (found.start(), _closing(text, found.end() - 1)))
    module = re.search(r"^PYBIND11_MODULE\([^)]*\)\s*\{", text, re.M)
    if module:
        spans["PYBIND11_MODULE"] = (module.start(), _closing(text, module.end() - 1))
    return spans


def gil_problems(text: str) -> list[str]:
    """Where the host path (module.mm and mps/host.h) holds the GIL too long or touches Python
    without it."""
    text = _strip_comments(text)
    spans = _function_spans(text)
    problems = []
    if "run_op" not in spans or "run_plan" not in spans:
        return ["run_op / run_plan not found"]
    start, end = spans["run_op"]
    body = text[text.index("{", start) : end]
    release = body.find("py::gil_scoped_release")
    if release < 0:
        problems.append("run_op does not release the GIL")
    else:
        after = body[release + len("py::gil_scoped_release") :]
        if "py::" in after or "to_options(" in after or "options_memo(" in after:
            problems.append("run_op uses a Python object after releasing the GIL")
        if "run_plan(" not in after:
            problems.append("run_op calls run_plan with the GIL held")
    # Run by run_op before it releases the GIL (the options memo, with the GIL by contract).
    with_gil = ("to_options", "OptionsMemo", "run_op", "PYBIND11_MODULE")
    allowed = [spans[name] for name in with_gil if name in spans]
    for found in re.finditer(r"\bpy::|\bPyObject\b|\bPy_\w+", text):
        if text[found.start() : found.start() + 24].startswith("py::gil_scoped_release"):
            continue
        if not any(a <= found.start() < b for a, b in allowed):
            line = text.count("\n", 0, found.start()) + 1
            problems.append(f"line {line} (comments stripped): Python API outside the GIL")
    return problems


def _host_path() -> str:
    """The code of a Metal op call: mps/host.h (run_plan_on, to_options) and module.mm."""
    return (MPS_DIR / "host.h").read_text() + (MPS_DIR / "module.mm").read_text()


def test_run_op_releases_the_gil():
    assert gil_problems(_host_path()) == []


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("  py::gil_scoped_release no_gil;\n", "", "does not release the GIL"),
        (
            "  const std::shared_ptr<const Options> parsed = options_memo().get(options, "
            "describe_device);\n  py::gil_scoped_release no_gil;\n",
            "  py::gil_scoped_release no_gil;\n  const std::shared_ptr<const Options> parsed = "
            "options_memo().get(options, describe_device);\n",
            "uses a Python object after releasing",
        ),
        (
            "  TensorList descs;\n",
            '  TensorList descs;\n  py::print("planning");\n',
            "Python API outside the GIL",
        ),
    ],
    ids=["no_release", "convert_after_release", "python_in_run_plan"],
)
def test_a_gil_mistake_is_reported(old, new, problem):
    text = _host_path()
    assert text.count(old) == 1, old
    problems = gil_problems(text.replace(old, new))
    assert any(problem in p for p in problems), problems


# ---- a nil compute encoder -------------------------------------------------------------------
#
# Messages to nil do nothing in Objective-C: encoding on a nil encoder would "succeed" and run_op
# would return uninitialised outputs. The block must test the encoder and report an error.


def nil_encoder_problems(text: str) -> list[str]:
    text = _strip_comments(text)
    uses = re.findall(r"commandEncoder\(\)", text)
    if len(uses) != 1:
        return [f"commandEncoder() is called {len(uses)} times (expected once, into a variable)"]
    found = re.search(
        r"id<MTLComputeCommandEncoder>\s+(\w+)\s*=\s*stream->commandEncoder\(\);\s*"
        r"if\s*\(\s*(\w+)\s*==\s*nil\s*\)\s*\{\s*error\s*=",
        text,
    )
    if not found or found.group(1) != found.group(2):
        return ["the compute encoder is not checked for nil (setting `error`) before its use"]
    return []


def test_a_nil_compute_encoder_is_an_error():
    assert nil_encoder_problems((MPS_DIR / "module.mm").read_text()) == []
    unchecked = (
        "        MetalBackend backend(stream->commandEncoder(), *pipelines_ptr, *slots_ptr);\n"
        "        CheckedEncoder<MetalBackend> encoder(backend, *present_ptr);\n"
        "        encode_plan(encoder, *plan_ptr);\n"
    )
    assert nil_encoder_problems(f"try {{\n{unchecked}}}") != []  # the host before the fix
