"""Build and install torch-steel.

On Linux (and any machine without MPS) nothing native is built at install time: the ops run
reference math, and the Metal simulator builds itself on first use (torch_steel.sim). A
non-editable install copies the sources the simulator compiles (shaders/, mps_src/plan,
mps_src/sim) into torch_steel/_native_src, so it works outside a checkout too.
On macOS, mps_src/mps/build_macos.py compiles the shaders into a metallib and builds the
Objective-C++ extension that encodes launch plans on PyTorch's MPS stream; that needs torch at
build time, which pyproject.toml's [build-system] table provides on macOS only. The sdist carries
every source this file reads (MANIFEST.in).
"""

import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# What the simulator compiles at first use (torch_steel/sim/build.py looks for it here when
# the package is not running from a checkout).
NATIVE_SOURCES = ["shaders", "mps_src/plan", "mps_src/sim"]


class BuildPyWithNativeSources(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return  # an editable install runs from the checkout, sources included
        target = Path(self.build_lib) / "torch_steel" / "_native_src"
        for rel in NATIVE_SOURCES:
            shutil.copytree(ROOT / rel, target / rel, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip


def macos_build_options():
    """The Mac build (metallib + Objective-C++ extension), or nothing elsewhere."""
    if sys.platform != "darwin":
        return {}
    sys.path.insert(0, str(ROOT / "mps_src" / "mps"))
    import build_macos  # noqa: PLC0415 (only importable, and only needed, on macOS)

    return build_macos.setup_options(ROOT)


options = macos_build_options()
options["cmdclass"] = {"build_py": BuildPyWithNativeSources, **options.get("cmdclass", {})}

setup(
    name="torch-steel",
    version="0.1.0",
    description="Flash attention and steel GEMM Metal kernels for PyTorch on Apple GPUs",
    packages=find_packages(include=["torch_steel", "torch_steel.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.13", "numpy"],
    extras_require={
        "test": [
            "pytest",
            "pytest-xdist",
            "ninja",
            "ruff",
            "hypothesis",
            "transformers",
            "diffusers",
        ],
        # bench/ --predict's plots (side_by_side.plot; without it the tables print, no plot)
        "bench": ["matplotlib"],
    },
    include_package_data=True,
    **options,
)
