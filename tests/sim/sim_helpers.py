"""Shared by the simulator's tests: they need clang-19, which builds the simulator."""

import shutil

import pytest

from torch_steel import _sim_build

requires_clang = pytest.mark.skipif(
    shutil.which(_sim_build.CXX) is None,
    reason=f"clang-19 is not installed ({_sim_build.INSTALL_HINT})",
)
