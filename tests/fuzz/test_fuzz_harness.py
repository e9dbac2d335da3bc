"""The fuzz harness itself (tests/fuzz/strategies.py): guard buffers see writes, layouts give the
strides they promise, and the attention strategy reaches every key-tile size of the plan."""

from __future__ import annotations

import pytest
import torch
from fuzz_helpers import fixed, requires_planner
from hypothesis import given
from strategies import Layout, _instantiation, guarded, sdpa_calls

from torch_steel import sim


def test_guard_sees_writes_to_elements_and_gaps():
    """A write into the view's elements, into a gap between them (inside the bound extent, where
    the simulator's out-of-bounds checker cannot see it) or past the view is reported."""
    layout = Layout((1, 0), (1, 2), (3, 1), 5, (False, False))  # transposed, strided, padded
    for where in ("element", "gap", "tail"):
        g = guarded("x", (4, 6), torch.float16, layout, torch.Generator().manual_seed(0))
        g.check()
        t = g.tensor
        if where == "element":
            t[1, 2] = 7.0
        elif where == "gap":
            g.buffer[t.storage_offset() + 1] = 0.0  # between two elements of a row of step 2
        else:
            g.buffer[-1] = 0.0
        with pytest.raises(AssertionError, match="written"):
            g.check()


def test_layouts_give_the_promised_strides():
    """Memory order, steps, padding, offset and expanded dims as Layout documents them, values
    intact."""
    layout = Layout((1, 0, 2), (1, 1, 2), (0, 2, 0), 3, (False, False, True))
    g = guarded("x", (2, 3, 5), torch.float32, layout, torch.Generator().manual_seed(0))
    t = g.tensor
    assert t.shape == (2, 3, 5) and t.storage_offset() == 3
    # stored [2, 5, 2] (dim 1 padded by 2, dim 2 of base size 1 at step 2), dim 1 outermost
    assert t.stride() == (2, 4, 0)
    assert bool((t == t[..., :1]).all())


def test_sdpa_strategy_reaches_every_key_tile():
    """sdpa_calls() draws calls on kernels of every key-tile size BK (steel_attn_bk in
    shaders/steel/params.h: 32 up to head dim 128 in f16, 16 up to 256, 8 for f32 at 512)."""
    seen = set()

    @fixed(400)  # draws only, no kernel runs: a fraction of a second
    @given(sdpa_calls())
    def draw(call):
        de, dv = _instantiation(call.E, call.Ev)
        seen.add(_bk(de, dv, call.dtype.itemsize))

    draw()
    assert seen == {8, 16, 32}


@requires_planner
def test_sdpa_instantiation_rule_is_the_plans():
    """strategies._instantiation picks the kernel attention_plan.cpp picks (the cost budget and
    the tile test above rely on it)."""
    pairs = [(1, 1), (33, 33), (100, 64), (64, 130), (161, 128), (193, 128), (300, 7),
             (513, 64), (520, 512), (576, 513), (576, 576)]  # fmt: skip
    for E, Ev in pairs:
        q = torch.zeros(1, 1, 2, E, dtype=torch.float16)
        k = torch.zeros(1, 1, 3, E, dtype=torch.float16)
        v = torch.zeros(1, 1, 3, Ev, dtype=torch.float16)
        de, dv = _instantiation(E, Ev)
        assert (
            sim.plan("sdpa", [q, k, v, None, None], {})
            .dispatches[0]
            .kernel.endswith(f"_e{de}_v{dv}")
        )


def _bk(de, dv, es):
    """steel_attn_bk (params.h) in Python."""
    ld = lambda d: d + 16 // es  # noqa: E731
    sep = lambda bk: bk * (ld(de) + ld(dv)) * es  # noqa: E731
    shared = lambda bk: bk * max(ld(de), ld(dv)) * es  # noqa: E731
    if sep(16) <= 20480:
        return 32 if sep(32) <= 20480 else 16
    return 32 if shared(32) <= 20480 else 16 if shared(16) <= 20480 else 8
