"""Kernels using what the pre-pass rewrites, run in the simulator: threadgroup arrays declared in
kernel bodies, [[threadgroup(n)]] parameters, position attributes as scalars and vectors,
function constants in vector arithmetic, and struct copies across address spaces (kernels:
tests/sim/kernels/lang_translate.metal, lang_struct_copy.metal)."""

from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

KERNELS = Path(__file__).parent / "kernels"
SRC = [KERNELS / "lang_translate.metal"]


pytestmark = requires_clang


def run(name, **kw):
    from torch_steel import sim

    return sim.run_kernel(name, sources=SRC, **kw)


@pytest.mark.parametrize(("gain", "negate"), [(2.0, False), (0.5, True)])
def test_threadgroup_arrays_and_function_constants(gain, negate):
    tgs, n, rows = 3, 32, 2
    out = torch.zeros(tgs * n * rows, 4)
    run(
        "lang_threadgroup_arrays",
        grid=(tgs, 1),
        threads=(n, rows),
        buffers={0: out},
        constants={0: gain, 1: negate},
    )
    s = -gain if negate else gain
    expected = torch.zeros(tgs, rows, n, 4)
    for tg in range(tgs):
        for x in range(n):
            nxt = (x + 1) % n
            expected[tg, :, x] = torch.tensor([tg * 100 + nxt, -nxt, 0.5, 0.0]) * s
        expected[tg, 1, :, 3] = s
    got = out.view(rows, tgs, n, 4).permute(1, 0, 2, 3)
    assert torch.equal(got, expected)


def test_threadgroup_parameter():
    out = torch.zeros(64, dtype=torch.int32)
    run(
        "lang_threadgroup_param",
        grid=(1,),
        threads=(64,),
        buffers={0: out},
        threadgroup_memory={0: 64 * 4},
    )
    assert out.tolist() == [(63 - t) ** 2 for t in range(64)]


def test_struct_copy_across_address_spaces():
    x = torch.randn(32, 8).half()
    out = torch.zeros(32, 8).half()
    from torch_steel import sim

    sim.run_kernel(
        "lang_struct_copy",
        sources=[KERNELS / "lang_struct_copy.metal"],
        grid=(1,),
        threads=(32,),
        buffers={0: x, 1: out},
    )
    assert torch.equal(out, x.flip(0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_mlx_style_source(dtype):
    from torch_steel import sim

    x = (torch.randn(2, 128) * 3).to(dtype)
    out = torch.zeros(4)
    name = "lang_softmax_stats_" + ("f16" if dtype == torch.float16 else "f32")
    sim.run_kernel(
        name,
        sources=[KERNELS / "lang_features.metal"],
        grid=(1,),
        threads=(64,),
        buffers={0: x, 1: out},
    )
    xf = x.double()
    row_max = xf.max(1).values
    row_sum = torch.exp(xf - row_max[:, None]).sum(1)
    # exp2 in binary32 of each of 128 terms, summed per lane then across lanes in fp32.
    assert torch.equal(out.view(2, 2)[:, 0].double(), row_max)
    assert torch.allclose(out.view(2, 2)[:, 1].double(), row_sum, rtol=1e-5)


def test_parameter_present_only_with_its_function_constant():
    out = torch.zeros(32)
    run(
        "lang_optional_buffer",
        grid=(1,),
        threads=(32,),
        buffers={0: out},
        constants={0: 1.0, 1: False, 2: False},
    )
    assert torch.equal(out, torch.arange(32.0))
    bias = torch.randn(32)
    run(
        "lang_optional_buffer",
        grid=(1,),
        threads=(32,),
        buffers={0: out, 1: bias},
        constants={0: 1.0, 1: False, 2: True},
    )
    assert torch.equal(out, torch.arange(32.0) + bias)
