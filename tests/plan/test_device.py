"""The device description's chip table (mps_src/plan/device.cpp, chip_dram_bytes_per_core_cycle):
the Metal host names the GPU (MTLDevice.name) and the plans take that chip's DRAM rate, the
figure the timing model computes from torch_steel/sim/chips.json, so that a plan made on the Mac
is the plan sim.predict judged."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from torch_steel import sim
from torch_steel.sim import build, timing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gemm"))
from gemm_helpers import requires_planner  # noqa: E402

pytestmark = requires_planner

FC_DECODE_ROWS = 340  # params.h STEEL_ATTN_FC_DECODE_ROWS


@pytest.mark.parametrize("chip", timing.chips())
def test_chip_dram_rate_is_the_timing_models(chip):
    """Every chip of chips.json is in the plans' table, at chips.json's bandwidth over its
    cores and clock (a figure edited in one place and not the other fails here), to the tenth
    of a byte the decode planner rounds it to (half up: M3 Max's 6.25 sits on the boundary)."""
    rate = build.extension().chip_dram_bytes_per_core_cycle(sim.metal_device_name(chip))
    expected = timing.dram_bytes_per_core_cycle(timing.chip(chip))
    assert rate == pytest.approx(expected, rel=1e-12)
    assert math.floor(rate * 10 + 0.5) == math.floor(expected * 10 + 0.5)


def test_the_chip_table_holds_only_the_timing_models_chips():
    """No name in the plans' table that chips.json does not describe (a chip dropped or renamed
    there must go here too), and none twice."""
    names = build.extension().chip_dram_names()
    assert sorted(names) == sorted(sim.metal_device_name(c) for c in timing.chips())


@pytest.mark.parametrize(
    "name", ["Apple M2 Pro", "Apple M1 Max ", "M1 Max", "apple m1 max", "", "AMD Radeon Pro 5500M"]
)
def test_an_unknown_gpu_has_no_rate(name):
    """Only Metal's exact names match; any other GPU plans with the default rate."""
    assert build.extension().chip_dram_bytes_per_core_cycle(name) == 0.0


@pytest.mark.parametrize(
    "chip,S,named,unnamed",
    [
        # At 8 bytes a core-cycle (no name), one head a threadgroup in one pass, reading K and V
        # four times through the L2 at 32, ties the DRAM floor and beats the full packing's
        # split by the merge: 213 us in the model against 190 at M1 Max's 9.6 bytes.
        ("M1 Max", 16384, (4, True), (1, False)),
        # At M3 Max's 6.25 bytes K and V read four times through the L2 cost less than the
        # DRAM floor: one head a threadgroup in one pass costs the floor, the full packing's
        # split the floor and the merge: 52 us in the model against 64 split 15 ways.
        ("M3 Max", 4096, (1, False), (4, True)),
    ],
)
def test_the_host_description_plans_as_predict(chip, S, named, unnamed):
    """What the Metal host describes (the core count and MTLDevice.name) makes the plan that
    sim.predict makes on the chip, where the DRAM rate decides it (f16 H32/8 d128, one token);
    without the name the plan differs."""
    q, k, v = (torch.empty(1, h, n, 128, dtype=torch.float16) for h, n in
               ((32, 1), (8, S), (8, S)))  # fmt: skip
    cores = int(timing.chip(chip)["gpu_cores"])

    def layout(options):
        p = sim.plan("sdpa", [q, k, v, None, None], {"scale": 0.088, **options})
        assert p.ok, p.reason
        return p

    host = layout({"gpu_cores": cores, "device_name": sim.metal_device_name(chip)})
    predicted = sim.predict("sdpa", [q, k, v, None, None], {"scale": 0.088}, chip=chip,
                            cache=False)  # fmt: skip
    assert [(d.kernel, d.grid[0] * d.grid[1] * d.grid[2]) for d in host.dispatches] == [
        (d["kernel"], d["occupancy"]["threadgroups"]) for d in predicted["dispatches"]
    ]
    for plan, (heads, split) in ((host, named), (layout({"gpu_cores": cores}), unnamed)):
        assert len(plan.dispatches) == (2 if split else 1)
        packed = plan.dispatches[0].constants[FC_DECODE_ROWS]  # heads a threadgroup x L
        assert packed == heads
