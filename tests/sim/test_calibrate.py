"""bench/calibrate.py's extrapolation: the counters it builds for a big attention call from a
small run of the same kernel (scaled per visited key tile) are the counters the simulator counts
on the big call itself, for a shape small enough to run whole."""

import sys
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel import sim

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_attention  # noqa: E402
import calibrate  # noqa: E402

pytestmark = requires_clang


@pytest.mark.parametrize("causal", [False, True])
def test_scaled_attention_counters_equal_a_whole_run(causal):
    B, H, N, D = 1, 2, 512, 64
    # Fitted from N = 128 and 256, so that the blocks-and-tiles fit is checked at a third size.
    scaled, dispatch, _ = calibrate.steel_attention_counters("M1", B, H, N, N, D, causal,
                                                             small=128)  # fmt: skip
    q, k, v, _ = bench_attention.inputs(B, H, H, N, N, D, D, None, torch.float16, "cpu")
    opts = bench_attention.run_options(D, {"is_causal": causal})
    _, (whole,) = sim.run_op("sdpa", [q, k, v, None, None], opts, counters=True, checkers=False)
    assert scaled["threadgroups"] == whole["threadgroups"]
    # Per visited key tile the kernel does the same work at any length, but for the key
    # fragments a tile crossing the diagonal skips (one such tile a block): threadgroup writes
    # and shuffles scale exactly, MMAs, threadgroup reads and simd operations fit exactly as
    # a * blocks + b * tiles. (Barriers do not: one per block is outside the key loop. The
    # model does not cost barriers.)
    for key in ("mma", "threadgroup_read", "threadgroup_written", "simd_ops", "shuffles"):
        assert scaled[key] == whole[key], key
    # The tensors' bytes come from the traffic model, equal to the count.
    for index, b in scaled["buffers"].items():
        assert b == whole["buffers"][index], index
    # Instruction classes and memory instructions also have a per-block part (setup, Q load, O
    # store): a * blocks + b * tiles is exact for both, up to float rounding of the fit.
    for key in calibrate.PER_BLOCK:
        assert scaled[key] == pytest.approx(whole[key], rel=1e-9), key
    for cls, n in whole["instructions"].items():
        assert scaled["instructions"][cls] == pytest.approx(n, rel=1e-9, abs=1e-6), cls
