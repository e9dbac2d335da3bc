"""Checks for the whole test session."""

import os

import pytest


def pytest_sessionstart(session):
    """In CI the Metal simulator must build: without it every kernel test skips, and a green run
    would have verified no kernel at all."""
    if not os.environ.get("CI"):
        return
    from torch_steel.errors import SimulatorError
    from torch_steel.sim import build

    if build._clang() is None:
        pytest.exit(f"CI: clang-19 is missing ({build.INSTALL_HINT})", returncode=1)
    try:
        build.extension()
        build.shader_library()
    except SimulatorError as e:
        pytest.exit(f"CI: the Metal simulator does not build: {e}", returncode=1)
