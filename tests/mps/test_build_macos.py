"""The macOS build helpers (mps_src/mps/build_macos.py), checked where they can run: here.

The metallib needs Xcode, but the shader amalgamation (the sources the Metal runtime compiler
gets when Xcode is missing) and the setup() options are plain Python.
"""

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHADERS = ROOT / "shaders"


def _load_build_macos():
    spec = importlib.util.spec_from_file_location(
        "build_macos", ROOT / "mps_src" / "mps" / "build_macos.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_macos = _load_build_macos()


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def tree(tmp_path):
    """shaders/ with a kernel including a header twice (directly and through another one)."""
    shaders = tmp_path / "shaders"
    _write(shaders / "steel" / "base.h", "#pragma once\nstruct Base { int x; };\n")
    _write(
        shaders / "steel" / "k" / "part.h",
        '#pragma once\n#include "../base.h"\nstruct Part { Base b; };\n',
    )
    kernel = _write(
        shaders / "steel" / "k" / "k.metal",
        '#include <metal_stdlib>\n#include "steel/base.h"\n#include "part.h"\n'
        "using namespace metal;\nkernel void k() {}\n",
    )
    return shaders, kernel


def _origins(amalgamated: str, shaders: Path):
    """(text, file, line) of every non-directive line, following the #line directives."""
    name, number = None, 0
    for text in amalgamated.splitlines():
        directive = re.match(r'#line (\d+) "([^"]+)"$', text)
        if directive:
            number, name = int(directive.group(1)), directive.group(2)
            continue
        yield text, name, number
        number += 1


def test_amalgamate_inlines_each_project_header_once(tree):
    shaders, kernel = tree
    text = build_macos.amalgamate(kernel, shaders)
    assert '#include "' not in text
    assert "#pragma once" not in text
    assert text.count("struct Base {") == 1
    assert text.index("struct Base {") < text.index("struct Part {") < text.index("kernel void k")
    assert "#include <metal_stdlib>" in text  # system headers stay for the Metal compiler


def test_amalgamate_line_directives_point_at_the_original_lines(tree):
    shaders, kernel = tree
    checked = 0
    for text, name, number in _origins(build_macos.amalgamate(kernel, shaders), shaders):
        original = (shaders / name).read_text().splitlines()[number - 1]
        if text:  # blank lines stand in for #pragma once
            assert text == original, (name, number)
            checked += 1
    assert checked == 5  # Base, Part, and the kernel file's three lines


def test_amalgamate_reports_a_missing_include(tree):
    shaders, _ = tree
    broken = _write(shaders / "steel" / "broken.metal", '#include "nowhere.h"\n')
    with pytest.raises(FileNotFoundError, match="nowhere.h"):
        build_macos.amalgamate(broken, shaders)


@pytest.mark.skipif(shutil.which("clang++-19") is None, reason="clang++-19 is not installed")
@pytest.mark.parametrize("source", build_macos.shader_files(SHADERS), ids=lambda p: p.name)
def test_shipped_sources_preprocess_like_the_originals(source, tmp_path):
    """What the runtime compiler gets is, token for token, what `xcrun metal -I shaders` reads."""
    stub = _write(tmp_path / "stub" / "metal_stdlib", "")  # keep <metal_stdlib> out of both
    amalgamated = _write(tmp_path / "amalgamated.metal", build_macos.amalgamate(source, SHADERS))

    def preprocess(path):
        out = subprocess.run(
            [
                "clang++-19",
                "-E",
                "-P",
                "-x",
                "c++",
                "-D__METAL_VERSION__=310",
                "-I",
                str(stub.parent),
                "-I",
                str(SHADERS),
                str(path),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    assert preprocess(amalgamated) == preprocess(source)


def test_install_shaders_without_the_toolchain_ships_sources(tmp_path, monkeypatch):
    if shutil.which("xcrun"):
        pytest.skip("xcrun is installed: this checks the install without Xcode")
    monkeypatch.delenv("TORCH_STEEL_NO_METALLIB", raising=False)
    package = tmp_path / "torch_steel"
    why, why_tensor = build_macos.install_shaders(SHADERS, package)
    assert why is not None and "xcrun" in why
    assert why_tensor is not None
    assert not (package / build_macos.METALLIB).exists()
    assert not (package / build_macos.TENSOR_OPS_METALLIB).exists()
    shipped = sorted((package / build_macos.SOURCE_DIR).glob("*.metal"))
    everything = build_macos.shader_files(SHADERS) + build_macos.tensor_op_files(SHADERS)
    assert sorted(p.name for p in shipped) == sorted(
        build_macos.source_name(s, SHADERS) for s in everything
    )
    assert all('#include "' not in p.read_text() for p in shipped)


@pytest.fixture
def mps_torch(monkeypatch):
    """torch as a Mac's torch with MPS says it is (this Linux torch is built without MPS)."""
    import torch

    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)


def test_setup_options(tmp_path, mps_torch):
    from torch.utils.cpp_extension import BuildExtension

    options = build_macos.setup_options(ROOT)
    (extension,) = options["ext_modules"]
    assert extension.name == "torch_steel._C_metal"
    sources = set(extension.sources)
    assert {"mps_src/mps/module.mm", "mps_src/mps/library.mm", "mps_src/plan/plan.cpp"} <= sources
    assert all((ROOT / s).is_file() for s in sources)
    planners = {f"mps_src/plan/{p.name}" for p in (ROOT / "mps_src" / "plan").glob("*.cpp")}
    assert planners <= sources  # every planner registers itself: all must be linked
    assert "-std=c++20" in extension.extra_compile_args
    assert "-fobjc-arc" in extension.extra_compile_args
    assert extension.extra_link_args == [
        "-framework",
        "Metal",
        "-framework",
        "Foundation",
        "-framework",
        "IOKit",  # the IORegistry's gpu-core-count (library.mm)
        "-framework",
        "CoreFoundation",
        "-lobjc",
        f"-mmacosx-version-min={build_macos.DEPLOYMENT_TARGET}",  # the link records it
    ]
    assert f"-mmacosx-version-min={build_macos.DEPLOYMENT_TARGET}" in extension.extra_compile_args
    assert issubclass(options["cmdclass"]["build_ext"], BuildExtension)
    assert options["package_data"] == {
        "torch_steel": [
            "steel.metallib",
            "steel_tensor_ops.metallib",
            "metal_src/*.metal",
            "_C_metal_build.json",
        ]
    }


def test_a_torch_without_mps_builds_no_extension(monkeypatch, capsys):
    """A Mac whose torch has no MPS (a CPU-only build): torch's BuildExtension would not even
    compile .mm files ("unknown file type '.mm'"), so the install is the reference-math package,
    and says so."""
    import torch

    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: False)
    assert build_macos.setup_options(ROOT) == {}
    assert "built without MPS" in capsys.readouterr().err


# ---- the MSL 4 tensor-op library: its own metallib, only with a macOS 26.2+ SDK -------------

FAKE_XCRUN = """#!/bin/sh
# xcrun as far as build_macos uses it: the SDK version from $FAKE_SDK, metal and metallib
# recorded in $FAKE_LOG (one line per call) and their -o output created.
if [ "$1" = "--sdk" ] && [ "$3" = "--show-sdk-version" ]; then echo "$FAKE_SDK"; exit 0; fi
echo "$*" >> "$FAKE_LOG"
out=""
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; fi; shift; done
[ -n "$out" ] && : > "$out"
exit 0
"""


@pytest.fixture
def fake_xcrun(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    _write(bin_dir / "xcrun", FAKE_XCRUN).chmod(0o755)
    log = tmp_path / "xcrun.log"
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.delenv("TORCH_STEEL_NO_METALLIB", raising=False)
    return log


def test_the_msl4_kernels_are_kept_out_of_the_main_library():
    main = build_macos.shader_files(SHADERS)
    tensor = build_macos.tensor_op_files(SHADERS)
    assert tensor and all(p.name.endswith("_msl4.metal") for p in tensor)
    assert not set(main) & set(tensor)
    names = {p.name for p in tensor}
    assert {"gemm_tensor_msl4.metal", "attention_tensor_msl4.metal"} <= names


@pytest.mark.parametrize("sdk", ["15.5", "26.1"])
def test_an_older_sdk_builds_no_tensor_op_library(sdk, fake_xcrun, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SDK", sdk)
    package = tmp_path / "torch_steel"
    why, why_tensor = build_macos.install_shaders(SHADERS, package)
    assert why is None and (package / build_macos.METALLIB).exists()
    assert "26.2" in why_tensor and sdk in why_tensor
    assert not (package / build_macos.TENSOR_OPS_METALLIB).exists()
    calls = fake_xcrun.read_text()
    assert "-std=metal4.0" not in calls and "_msl4.metal" not in calls


@pytest.mark.parametrize("sdk", ["26.2", "27.0"])
def test_a_new_sdk_builds_the_tensor_op_library_apart(sdk, fake_xcrun, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SDK", sdk)
    package = tmp_path / "torch_steel"
    assert build_macos.install_shaders(SHADERS, package) == (None, None)
    assert (package / build_macos.TENSOR_OPS_METALLIB).exists()
    compiles = [c for c in fake_xcrun.read_text().splitlines() if " metal " in f" {c} "]
    msl4 = [c for c in compiles if "_msl4.metal" in c]
    assert msl4 and all("-std=metal4.0" in c and "-mmacosx-version-min=26.2" in c for c in msl4)
    assert all("-std=metal3.1" in c for c in compiles if c not in msl4)
