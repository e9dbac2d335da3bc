"""Values that must come out as on an Apple GPU, and conversions that MSL leaves undefined and
the simulator reports (kernels: tests/sim/kernels/lang_fidelity.metal)."""

import struct
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel import sim
from torch_steel.errors import SimulatorError

SRC = [Path(__file__).parent / "kernels" / "lang_fidelity.metal"]

pytestmark = requires_clang


def run(name, **kw):
    return sim.run_kernel(name, sources=SRC, **kw)


def test_vector_bool_converts_to_one():
    x = torch.tensor([1.0, -2.0, 0.0, 3.0])
    out = torch.zeros(16)
    iout = torch.zeros(4, dtype=torch.int32)
    run("lang_bool_vector_to_number", grid=(1,), threads=(1,), buffers={0: x, 1: out, 2: iout})
    assert out[0:4].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert out[4:8].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert iout.tolist() == [1, 0, 0, 1]
    assert out[8:12].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert out[12:16].tolist() == [-1.0] * 4


def test_fract_of_half_stays_below_one():
    x = torch.tensor([-1e-4, -0.0, 1.5, -2.25, 65504.0, -1e-3], dtype=torch.float16)
    out = torch.zeros(6, dtype=torch.float16)
    run("lang_fract_half", grid=(1,), threads=(6,), buffers={0: x, 1: out})
    largest_below_one = float(torch.tensor(1.0, dtype=torch.float16) - 2**-11)
    expected = [largest_below_one, 0.0, 0.5, 0.75, 0.0, float(torch.tensor(1 - 1e-3).half())]
    assert out.float().tolist() == pytest.approx(expected, abs=0)
    assert (out < 1).all()


@pytest.mark.parametrize("which", [0, 1, 2, 3], ids=["int", "uint", "int4", "half-short"])
def test_float_to_int_out_of_range_or_nan_is_reported(which):
    fine = (
        torch.tensor([1.5, -2.5, 100.0, 0.0]) if which != 1 else torch.tensor([1.5, 2.0, 0.0, 7.9])
    )
    out = torch.zeros(4, dtype=torch.int32)
    run(
        "lang_float_to_int",
        grid=(1,),
        threads=(4,),
        buffers={0: fine, 1: out, 2: struct.pack("<I", which)},
    )
    assert out.tolist() == fine.trunc().int().tolist()
    bad = {0: 3e9, 1: -5.0, 2: float("nan"), 3: 40000.0}[which]
    with pytest.raises(
        SimulatorError, match=r"lang_float_to_int.*(cannot represent|undefined in MSL)"
    ):
        run(
            "lang_float_to_int",
            grid=(1,),
            threads=(4,),
            buffers={0: torch.tensor([1.0, bad, 2.0, 3.0]), 1: out, 2: struct.pack("<I", which)},
        )


def test_own_fast_overload_does_not_capture_float_calls():
    x = torch.tensor([0.1, 0.3, 1.7, -2.2])
    out = torch.zeros(4)
    hout = torch.zeros(4, dtype=torch.float16)
    run("lang_fast_overload", grid=(1,), threads=(4,), buffers={0: x, 1: out, 2: hout})
    assert torch.allclose(out.double(), torch.exp2(x.double()), rtol=1e-6, atol=0)
    assert torch.equal(hout, torch.exp2(x.half().float()).half())
