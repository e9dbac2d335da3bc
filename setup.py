"""Build and install torch-steel.

On Linux (and any machine without MPS) nothing native is built at install time: the ops run
reference math, and the Metal simulator builds itself on first use (torch_steel.sim).
On macOS, mps_src/mps/build_macos.py compiles the shaders into a metallib and builds the
Objective-C++ extension that encodes launch plans on PyTorch's MPS stream.
"""

import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def macos_build_options():
    """The Mac build (metallib + Objective-C++ extension), or nothing elsewhere."""
    if sys.platform != "darwin":
        return {}
    sys.path.insert(0, str(ROOT / "mps_src" / "mps"))
    import build_macos  # noqa: PLC0415 (only importable, and only needed, on macOS)

    return build_macos.setup_options(ROOT)


setup(
    name="torch-steel",
    version="0.1.0",
    description="Flash attention and steel GEMM Metal kernels for PyTorch on Apple GPUs",
    packages=find_packages(include=["torch_steel", "torch_steel.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.13", "numpy"],
    extras_require={"test": ["pytest", "pytest-xdist", "ninja", "ruff"]},
    include_package_data=True,
    **macos_build_options(),
)
