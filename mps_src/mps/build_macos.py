"""The macOS build: the shaders' metallib and the Objective-C++ extension torch_steel._C_metal.

setup.py calls setup_options(root) on darwin only and passes the result to setup(). The build_ext
command builds the extension, then puts next to it, inside the torch_steel package:

- steel.metallib: every shaders/**/*.metal compiled by Xcode's Metal toolchain (`xcrun metal`,
  one .air per file, linked by `xcrun metallib`). Skipped, with a message, when the toolchain is
  missing: it ships with Xcode, not with the Command Line Tools.
- steel_tensor_ops.metallib: the MSL 4 kernels (shaders/**/*_msl4.metal: Metal 4 tensor ops for
  M5-generation GPUs), compiled with -std=metal4.0 for macOS 26.2, only when the SDK is macOS
  26.2 or newer; otherwise skipped with a message, and those kernels are absent (the plans keep
  to the simdgroup kernels). Loaded at run time only where the device reports Metal 4.
- metal_src/*.metal: the same shaders, each amalgamated into one self-contained source (the
  project's own #includes inlined, since MTLDevice.newLibraryWithSource has no include path).
  The extension compiles these with the Metal runtime compiler at first use when no metallib
  was built.

- _C_metal_build.json: the torch version the extension was compiled against, which
  torch_steel.metal checks before importing it (the extension is tied to that torch's C++ ABI).

With a torch built without MPS (a CPU-only build) there is no extension: torch's BuildExtension
compiles .mm files only when torch.backends.mps.is_built(), and the package installs as reference
math. amalgamate() is plain Python with no macOS dependency, so tests/mps checks it on Linux.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

METALLIB = "steel.metallib"
SOURCE_DIR = "metal_src"
# bfloat arrived in Metal 3.1 (macOS 14). -fno-fast-math because Metal compiles with fast math by
# default, which may assume no inf/NaN (attention's masked -inf scores) and reassociate, while
# the simulator that verifies the kernels computes IEEE math (kernels ask for fast:: explicitly).
# The oldest macOS the build supports: the metallib, the extension's compile and its link (the
# link records the minimum OS in the binary) all use it, and tests/mps/test_objc_check.py checks
# the Objective-C++ host's API use against it.
DEPLOYMENT_TARGET = "14.0"
MIN_VERSION_FLAG = f"-mmacosx-version-min={DEPLOYMENT_TARGET}"
METAL_FLAGS = ["-std=metal3.1", MIN_VERSION_FLAG, "-fno-fast-math", "-Wall"]
# The tensor-op kernels: MSL 4.0 (metal_tensor, MetalPerformancePrimitives), which needs a macOS
# 26.2 SDK and deployment target (earlier SDKs lack matmul2d's shape rules and bf16 support).
TENSOR_OPS_METALLIB = "steel_tensor_ops.metallib"
# The simulator compiles these as MSL 4 too (torch_steel/sim/build.py).
TENSOR_OPS_SUFFIX = "_msl4.metal"
TENSOR_OPS_MIN_SDK = (26, 2)
TENSOR_OPS_MIN_VERSION_FLAG = "-mmacosx-version-min=26.2"
TENSOR_OPS_FLAGS = ["-std=metal4.0", TENSOR_OPS_MIN_VERSION_FLAG, "-fno-fast-math", "-Wall"]
# Written next to the extension: the torch it was compiled against. The extension is tied to that
# torch's C++ ABI; torch_steel.metal reads this before importing it and keeps to reference math,
# with a warning, when another torch is running.
BUILD_INFO = "_C_metal_build.json"
TOOLCHAIN_HINT = (
    "the Metal toolchain ships with Xcode, not the Command Line Tools (install Xcode, run "
    "`sudo xcode-select -s /Applications/Xcode.app`; Xcode 26 and later also need "
    "`xcodebuild -downloadComponent MetalToolchain`)"
)

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\b")


def shader_files(shaders: Path) -> list[Path]:
    """The MSL 3.1 translation units: every .metal file under shaders/ but the MSL 4 ones, in a
    stable order."""
    return sorted(p for p in shaders.rglob("*.metal") if not p.name.endswith(TENSOR_OPS_SUFFIX))


def tensor_op_files(shaders: Path) -> list[Path]:
    """The MSL 4 translation units (*_msl4.metal), in a stable order."""
    return sorted(shaders.rglob("*" + TENSOR_OPS_SUFFIX))


def amalgamate(source: Path, shaders: Path) -> str:
    """source with every project #include "..." inlined, recursively, each file once.

    A quoted include is looked up next to the including file, then under shaders/ (the include
    path the metallib build uses). <...> includes (metal_stdlib) stay. #line directives keep
    runtime compiler errors pointing at the original files.
    """
    seen: set[Path] = set()
    out: list[str] = []

    def name(path: Path) -> str:
        try:
            return path.relative_to(shaders).as_posix()
        except ValueError:
            return path.name

    def inline(path: Path) -> None:
        path = path.resolve()
        if path in seen:
            return
        seen.add(path)
        out.append(f'#line 1 "{name(path)}"')
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            include = _INCLUDE.match(line)
            if _PRAGMA_ONCE.match(line):
                out.append("")
            elif include:
                inline(_find_include(include.group(1), path, shaders))
                out.append(f'#line {number + 1} "{name(path)}"')
            else:
                out.append(line)

    inline(source)
    return "\n".join(out) + "\n"


def _find_include(target: str, including: Path, shaders: Path) -> Path:
    for base in (including.parent, shaders):
        candidate = base / target
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f'{including}: #include "{target}" is found neither next to it nor in {shaders}'
    )


def source_name(source: Path, shaders: Path) -> str:
    """steel/gemm/gemm.metal -> steel__gemm__gemm.metal (one flat directory in the package)."""
    return "__".join(source.relative_to(shaders).parts)


def write_sources(shaders: Path, out_dir: Path) -> list[Path]:
    """Writes the amalgamated shader sources into out_dir/metal_src/ (replacing older ones)."""
    target = out_dir / SOURCE_DIR
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    written = []
    for source in shader_files(shaders) + tensor_op_files(shaders):
        path = target / source_name(source, shaders)
        path.write_text(amalgamate(source, shaders))
        written.append(path)
    return written


def compile_metallib(
    shaders: Path, out: Path, sources: list[Path] | None = None, flags: list[str] = METAL_FLAGS
) -> str | None:
    """Compiles `sources` (default: shader_files) into one metallib at `out` with `flags`;
    returns None, or why it could not."""
    sources = shader_files(shaders) if sources is None else sources
    if not sources:
        return "no shaders to compile"
    with tempfile.TemporaryDirectory() as tmp:
        airs = []
        try:
            for i, source in enumerate(sources):
                air = Path(tmp) / f"{i}_{source.stem}.air"
                _run(
                    [
                        "xcrun",
                        "-sdk",
                        "macosx",
                        "metal",
                        *flags,
                        "-I",
                        str(shaders),
                        "-c",
                        str(source),
                        "-o",
                        str(air),
                    ]
                )
                airs.append(str(air))
            _run(["xcrun", "-sdk", "macosx", "metallib", *airs, "-o", str(out)])
        except FileNotFoundError as error:
            return f"xcrun not found ({error})"
        except subprocess.CalledProcessError as error:
            out.unlink(missing_ok=True)
            return f"`{' '.join(error.cmd[:4])} ...` failed:\n{error.stderr.strip()}"
    return None


def sdk_version() -> tuple[int, ...] | None:
    """The macOS SDK's version (`xcrun --sdk macosx --show-sdk-version`), None without one."""
    try:
        out = subprocess.run(
            ["xcrun", "--sdk", "macosx", "--show-sdk-version"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return tuple(int(part) for part in out.split("."))
    except (OSError, subprocess.CalledProcessError, ValueError):
        return None


def compile_tensor_ops_metallib(shaders: Path, out: Path) -> str | None:
    """The MSL 4 kernels' metallib at `out`; returns None, or why it was not built (an SDK
    older than macOS 26.2 has no MSL 4 tensor ops: the install goes on without them)."""
    sources = tensor_op_files(shaders)
    if not sources:
        return "no MSL 4 shaders"
    version = sdk_version()
    if version is None:
        return "no macOS SDK found (xcrun)"
    if version < TENSOR_OPS_MIN_SDK:
        wanted = ".".join(map(str, TENSOR_OPS_MIN_SDK))
        return (
            f"the macOS SDK is {'.'.join(map(str, version))}; MSL 4 tensor ops need {wanted} "
            "or newer (Xcode 26.2)"
        )
    return compile_metallib(shaders, out, sources, TENSOR_OPS_FLAGS)


def install_shaders(shaders: Path, package_dir: Path) -> tuple[str | None, str | None]:
    """Writes metal_src/ and, when the toolchain allows, steel.metallib and
    steel_tensor_ops.metallib into package_dir.

    Returns (why steel.metallib was not built, why the tensor-op one was not), None where it was
    built; the install goes on without either. TORCH_STEEL_NO_METALLIB=1 skips both, to try the
    runtime-compiler path on a Mac that has Xcode.
    """
    package_dir.mkdir(parents=True, exist_ok=True)
    write_sources(shaders, package_dir)
    metallib = package_dir / METALLIB
    tensor_metallib = package_dir / TENSOR_OPS_METALLIB
    metallib.unlink(missing_ok=True)
    tensor_metallib.unlink(missing_ok=True)
    if os.environ.get("TORCH_STEEL_NO_METALLIB"):
        return "TORCH_STEEL_NO_METALLIB is set", "TORCH_STEEL_NO_METALLIB is set"
    why = compile_metallib(shaders, metallib)
    return why, compile_tensor_ops_metallib(shaders, tensor_metallib)


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def write_build_info(package_dir: Path, torch_version: str) -> Path:
    """Records, next to the extension, the torch version it was built against."""
    path = package_dir / BUILD_INFO
    path.write_text(json.dumps({"torch": torch_version}) + "\n")
    return path


NO_MPS_MESSAGE = (
    "torch-steel: this torch is built without MPS (torch.backends.mps.is_built() is False): "
    "installing without the Metal extension; the ops run reference math"
)


def setup_options(root: Path) -> dict:
    """setup() keyword arguments for the Mac build (ext_modules, cmdclass, package_data).

    Empty when the torch present at build time has no MPS (a CPU-only build): torch's
    BuildExtension compiles .mm files only when torch.backends.mps.is_built(), so the extension
    could not build, and could not run either.
    """
    import torch  # noqa: PLC0415
    from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: PLC0415

    if not torch.backends.mps.is_built():
        print(NO_MPS_MESSAGE, file=sys.stderr)
        return {}

    shaders = root / "shaders"

    class BuildWithShaders(BuildExtension):
        """build_ext, then the shader library next to the extension (in-place or build dir)."""

        def run(self):
            super().run()
            package_dir = Path(self.get_ext_fullpath("torch_steel._C_metal")).parent
            write_build_info(package_dir, torch.__version__)
            why, why_tensor = install_shaders(shaders, package_dir)
            if why_tensor is None:
                print(f"torch-steel: built {package_dir / TENSOR_OPS_METALLIB}")
            else:
                print(f"torch-steel: no MSL 4 tensor-op kernels ({why_tensor.splitlines()[0]})")
            if why is None:
                print(f"torch-steel: built {package_dir / METALLIB}")
            else:
                print(
                    f"torch-steel: WARNING: no metallib built ({why}).\n"
                    f"torch-steel: {TOOLCHAIN_HINT}.\n"
                    "torch-steel: installing the shader sources instead; they are compiled by "
                    "the Metal runtime compiler the first time a process uses a kernel.",
                    file=sys.stderr,
                )

    def rel(path: Path) -> str:
        return os.path.relpath(path, root)

    sources = sorted((root / "mps_src" / "mps").glob("*.mm"))
    sources += sorted((root / "mps_src" / "plan").glob("*.cpp"))
    extension = CppExtension(
        "torch_steel._C_metal",
        sources=[rel(p) for p in sources],
        include_dirs=[str(root / "mps_src"), str(shaders)],
        # -std=c++20: torch 2.13's headers expect it (DESIGN.md section 6). ARC manages the
        # Objective-C objects held in C++ containers (pipeline cache, encoder state).
        extra_compile_args=["-std=c++20", "-fobjc-arc", MIN_VERSION_FLAG],
        # libobjc: ARC's objc_retain / objc_release, named rather than left to Foundation. IOKit
        # and CoreFoundation: the GPU's core count from the IORegistry (library.mm). The
        # minimum macOS again at the link, which writes it into the binary's load commands.
        extra_link_args=[
            "-framework",
            "Metal",
            "-framework",
            "Foundation",
            "-framework",
            "IOKit",
            "-framework",
            "CoreFoundation",
            "-lobjc",
            MIN_VERSION_FLAG,
        ],
    )
    return {
        "ext_modules": [extension],
        "cmdclass": {"build_ext": BuildWithShaders},
        "package_data": {
            "torch_steel": [METALLIB, TENSOR_OPS_METALLIB, f"{SOURCE_DIR}/*.metal", BUILD_INFO]
        },
    }
