"""AttnParams reads of the forward kernels: the key-tile loops keep the fields they use in
registers (forward.h, decode.h, score.h), so that a lane reads at most one struct's worth of the
params binding per launch, whatever the number of key tiles.

The oracle of the bound is the binding's own size (the plan's setBytes length) times the lanes
of the dispatch, from the simulator's counters; before the loop fields were hoisted a lane read
520 bytes of the 312-byte AttnParams at prefill L=S=100 and more with every key tile. Out is
checked against float64 reference math with attn_helpers' tolerances, on ragged lengths.
"""

from __future__ import annotations

import pytest
from attn_helpers import assert_attention_close, oracle, qkv, requires_simulator, scale_of

from torch_steel import sim

pytestmark = requires_simulator

BUF_PARAMS = 7  # STEEL_ATTN_BUF_PARAMS (shaders/steel/params.h)

# (B, Hq, Hkv, L, S, E, options): the prefill shape; decode GQA and MHA with S cut for
# the simulator, one pass and split; a causal prefill over nine key tiles.
SHAPES = [
    (2, 4, 2, 100, 100, 64, {}),
    (1, 2, 1, 40, 257, 64, {"is_causal": True}),
    (1, 32, 8, 1, 289, 128, {"num_splits": 1}),
    (1, 8, 8, 1, 513, 64, {"num_splits": 3}),
]


@pytest.mark.parametrize("B,Hq,Hkv,L,S,E,extra", SHAPES)
def test_each_lane_reads_the_params_at_most_once(B, Hq, Hkv, L, S, E, extra):
    q, k, v = qkv(B, Hq, L, S, E, Hkv=Hkv)
    opts = {"scale": scale_of(E), "is_causal": False, **extra}
    p = sim.plan("sdpa", [q, k, v, None, None], opts)
    sizes = [len(next(b.bytes for b in d.bindings if b.index == BUF_PARAMS)) for d in p.dispatches]
    (out, lse), counters = sim.run_op("sdpa", [q, k, v, None, None], opts, counters=True)
    assert len(counters) == len(sizes)
    for c, size in zip(counters, sizes, strict=True):
        read = c["buffers"][BUF_PARAMS]["read"]
        assert 0 < read <= c["lanes"] * size, (c["kernel"], read / c["lanes"], size)
    ref_out, ref_lse = oracle(q, k, v, enable_gqa=True, is_causal=extra.get("is_causal", False))
    assert_attention_close(out, lse, ref_out, ref_lse, q.dtype, float(v.abs().max()))
