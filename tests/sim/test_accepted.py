"""Constructs that Metal accepts must build and run here too (kernels:
tests/sim/kernels/lang_accepted.metal, with <sub/helper.h> from kernels/accepted_inc)."""

from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel import sim
from torch_steel.errors import SimulatorError

KERNELS = Path(__file__).parent / "kernels"
SRC = [KERNELS / "lang_accepted.metal"]
INC = [KERNELS / "accepted_inc"]

pytestmark = requires_clang


def run(name, **kw):
    return sim.run_kernel(name, sources=SRC, include_dirs=INC, **kw)


def test_template_kernel_with_default_arguments_and_metal_array():
    for suffix, dtype in (("f32", torch.float32), ("half", torch.float16), ("int", torch.int32)):
        out = torch.zeros(8, dtype=dtype)
        run(f"accepted_template_{suffix}", grid=(1,), threads=(8,), buffers={0: out})
        assert out.tolist() == [float(i % 4 + 4) for i in range(8)]


def test_forward_declared_kernel_constant_bound_and_helpers():
    out = torch.zeros(8)
    run("accepted_forward", grid=(1,), threads=(8,), buffers={0: out})
    assert out.tolist() == [i * 3.0 - 128.0 for i in range(8)]


def test_constant_array_parameter():
    out = torch.zeros(1)
    run("accepted_constant_array", grid=(1,), threads=(1,), buffers={0: out})
    assert out.item() == 10.0


def test_template_kernel_with_dependent_thread_limit_and_threadgroup_array():
    out = torch.zeros(64)
    run("accepted_limited_2", grid=(1,), threads=(64,), buffers={0: out})
    assert out.tolist() == [float(i + (i + 1) % 64) for i in range(64)]
    # [[max_total_threads_per_threadgroup(kWarps * 32)]] of this instance is 64.
    with pytest.raises(SimulatorError, match="max_total_threads_per_threadgroup"):
        run("accepted_limited_2", grid=(1,), threads=(96,), buffers={0: torch.zeros(96)})


def test_default_argument_before_a_body_with_a_threadgroup_array():
    out = torch.zeros(4)
    run("accepted_default_argument", grid=(1,), threads=(4,), buffers={0: out})
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_address_space_qualified_member_functions_on_device_objects():
    pairs = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    out = torch.zeros(6)
    run("accepted_device_members", grid=(1,), threads=(2,), buffers={0: pairs, 1: out})
    assert out.tolist() == [-1.0, 3.0, 60.0, -2.0, 8.0, 160.0]
    assert pairs.tolist() == [[2.0, 4.0], [6.0, 10.0]]
