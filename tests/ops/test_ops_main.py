"""python -m torch_steel: the self-check a new user runs first."""

import os
import subprocess
import sys


def test_self_check_runs_and_passes():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_STEEL_")}
    result = subprocess.run(
        [sys.executable, "-m", "torch_steel"], capture_output=True, text=True, env=env, timeout=900
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for line in ("best backend here:", "steel::sdpa_backward", "sdpa backward", "gemm"):
        assert line in result.stdout
    assert "self-check passed" in result.stdout
