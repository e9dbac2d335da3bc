"""Shared by the simulator's tests: they need clang-19, which builds the simulator."""

import shutil

import pytest

from torch_steel.sim import build

requires_clang = pytest.mark.skipif(
    shutil.which(build.CXX) is None,
    reason=f"clang-19 is not installed ({build.INSTALL_HINT})",
)
