"""Property-based differential tests of steel::gemm (shaders/steel/gemm, plan
mps_src/plan/gemm_plan.cpp) in the Metal simulator, checkers on.

For calls drawn by strategies.gemm_calls() (every tile regime of the plan, edges, split-K, batch
broadcast and folding, transposed / strided / padded / offset / stride-0 operands, alpha, beta,
c broadcast, bias, every activation, all three dtypes): the kernel agrees with float64 math
within gemm_helpers.assert_close's bound (the output dtype's rounding plus the fp32
accumulation error of K products), and no byte of any input's guard buffer changed. For calls
drawn by strategies.gemm_refusals(): the plan refuses with a reason.

The default run checks a fixed-seed subset; `-m fuzz` runs thousands of random calls with
hypothesis' example database (see fuzz_helpers).
"""

from __future__ import annotations

import pytest
import torch
from fuzz_helpers import assert_refused, fixed, fuzz, fuzz_mark, requires_simulator, strict_sim
from gemm_helpers import assert_close, reference
from hypothesis import given
from strategies import gemm_calls, gemm_refusals

import torch_steel
from torch_steel import sim

pytestmark = requires_simulator


def check_gemm(call):
    """Kernel vs float64 oracle, then the guard buffers."""
    t, guards = call.build()
    with strict_sim():
        out = torch_steel.gemm(t["a"], t["b"], bias=t["bias"], c=t["c"], alpha=call.alpha,
                               beta=call.beta, activation=call.activation)  # fmt: skip
    check_result(call, t, guards, out)


def check_result(call, t, guards, out):
    """out against the float64 oracle within assert_close's bound; every guard intact."""
    ref, mag = reference(t["a"], t["b"], t["bias"], t["c"], call.alpha, call.beta,
                         call.activation)  # fmt: skip
    assert out.shape == call.out_shape()
    assert_close(out, ref, mag, call.K, call.dtype)
    for g in guards:
        g.check()


def gemm_kernel_family(call):
    """The campaign's kernel name for a call: "gemv" where the plan serves it with a GEMV
    kernel, else "gemm" (calls of the gemv regime that fold a batch into M, or whose size-1 dim
    leaves the layout ambiguous, go to the tiled kernels)."""
    t, _ = call.build()
    options = {"alpha": call.alpha, "beta": call.beta, "activation": call.activation}
    kernel = sim.plan("gemm", [t["a"], t["b"], t["bias"], t["c"]], options).dispatches[0].kernel
    return "gemv" if kernel.startswith("steel_gemv") else "gemm"


@fixed(100)
@given(gemm_calls())
def test_gemm_matches_float64(call):
    """Fixed-seed subset: 100 drawn calls agree with float64 math and leave their inputs and
    guard bytes untouched."""
    check_gemm(call)


@fixed(40)
@given(gemm_refusals())
def test_gemm_refusals_have_a_reason(case):
    """Fixed-seed subset: calls outside the plan's envelope are refused with a reason."""
    what, tensors, options = case
    assert_refused("gemm", tensors, options)


@fuzz_mark
@fuzz(lambda call: [gemm_kernel_family(call)])
@given(gemm_calls())
def test_fuzz_gemm(call):
    """-m fuzz: random calls agree with float64 math and leave their guard buffers untouched."""
    check_gemm(call)


@fuzz_mark
@fuzz(lambda call: [gemm_kernel_family(call)])
@given(gemm_calls(regimes=("gemv",)))
def test_fuzz_gemv(call):
    """-m fuzz: random decode-shaped calls (at most 8 rows or columns, the GEMV kernels' layout,
    ragged K and line counts, batches, offsets and padded lines) agree with float64 math and
    leave their guard buffers untouched."""
    check_gemm(call)


@fuzz_mark
@fuzz(lambda case: ["refusals"])
@given(gemm_refusals())
def test_fuzz_gemm_refusals(case):
    """-m fuzz: random calls outside the envelope are refused with a reason."""
    what, tensors, options = case
    assert_refused("gemm", tensors, options)


@pytest.mark.parametrize(
    "regime,tile",
    [("edges", "bm32_bn32"), ("large", "bm64_bn64"), ("thin", "bm32_bn128"),
     ("tall", "bm128_bn32"), ("splitk", "splitk"), ("gemv", "gemv_rows"),
     ("gemv", "gemv_cols")],
)  # fmt: skip
def test_strategy_reaches_every_tile(regime, tile):
    """Each regime of gemm_calls() reaches the kernel of the tile table it aims at (a strategy
    that drifted off a tile would fuzz it no more)."""
    seen = []

    @fixed(10)
    @given(gemm_calls(dtypes=(torch.float16,), regimes=(regime,)))
    def draw(call):
        t, _ = call.build()
        options = {"alpha": call.alpha, "beta": call.beta, "activation": call.activation}
        p = sim.plan("gemm", [t["a"], t["b"], t["bias"], t["c"]], options)
        seen.append(tile in p.dispatches[0].kernel)

    draw()
    assert any(seen), f"no {regime} call ran a {tile} kernel"
