"""The vector decode kernel (shaders/steel/attn/decode_vector.h, chosen by decode_plan.cpp's
decode_vector rule by default; option decode_vector = 0 keeps the MMA kernel) in the Metal
simulator, checkers on, against float64 reference math. The rule takes it where the GQA
group's packed rows (group x L) fit STEEL_ATTN_DECODE_VECTOR_ROWS = 8. Here: ragged key counts
(S % 32 in {1, 31}, S = 1), GQA 1/4/8 at L 1..8, every dtype, strided K/V views, masks, split-K
and its merge, and the plan's choice against the MMA kernel (decode_vector = 0). Tolerances are
attn_helpers.assert_attention_close's (fp32 accumulation, one rounding of out to its dtype); the
vector kernel sums each score over 32 lanes in fp32, a different order from the MMA's, well
inside them.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from attn_helpers import (
    DTYPES,
    FC_DECODE_DIRECT,
    assert_attention_close,
    oracle,
    qkv,
    rand,
    requires_simulator,
    score_error,
)

import torch_steel
from torch_steel import ops, sim
from torch_steel.sim import timing

pytestmark = requires_simulator

FC_DECODE_SIMDGROUPS = 341  # params.h STEEL_ATTN_FC_DECODE_SIMDGROUPS


def _run(q, k, v, mask=None, num_splits=0, vector=True, width=0, heads=0, direct=None, **kwargs):
    """(out, lse, kernel, splits) of sdpa on the simulator with the vector rule on or off;
    width: the vector kernel's simdgroups (decode_simdgroups: 4, 8 or 16; 0 the plan's); heads:
    the query heads a threadgroup (decode_heads_per_tg; 0 the plan's); direct: the decode_direct
    option (None the plan's; 1 asserts the plan takes direct reads)."""
    inputs, _ = ops.attention_ops._sdpa_inputs(q, k, v, mask, 0.0, kwargs.pop("is_causal", False),
                                 kwargs.pop("scale", None), True, kwargs.pop("sinks", None),
                                 kwargs.pop("softcap", None), kwargs.pop("window", None),
                                 kwargs.pop("causal_align", "top_left"), None, 0)  # fmt: skip
    assert not kwargs, kwargs
    attn = ops.Attn(*inputs[4:])._replace(num_splits=num_splits)
    options = {**attn.run_options(), "decode_vector": 1 if vector else 0}
    if width:
        options["decode_simdgroups"] = width
    if heads:
        options["decode_heads_per_tg"] = heads
    if direct is not None:
        options["decode_direct"] = direct
    tensors = [*inputs[:4], attn.sinks]
    p = sim.plan("sdpa", tensors, options)
    assert p.ok, p.reason
    if heads:  # the grid's y: KV heads x the threadgroups of a group
        assert p.dispatches[0].grid[1] == q.shape[-3] // heads, p.dispatches[0].grid
    if width and vector:
        assert p.dispatches[0].threads == (32 * width, 1, 1)
        assert p.dispatches[0].constants[FC_DECODE_SIMDGROUPS] == width
    if direct is not None and vector:
        assert p.dispatches[0].constants[FC_DECODE_DIRECT] == bool(direct)
    out, lse = sim.run_op("sdpa", tensors, options, checkers=True)[:2]
    return out, lse, p.dispatches[0].kernel, p.dispatches[0].grid[0]


def check(q, k, v, mask=None, num_splits=0, vector=True, width=0, heads=0, direct=None, **kwargs):
    out, lse, kernel, splits = _run(q, k, v, mask, num_splits, vector, width, heads, direct,
                                    **dict(kwargs))  # fmt: skip
    ref_out, ref_lse = oracle(q, k, v, mask, enable_gqa=True, **kwargs)
    v_max = float(v.double().abs().max()) if v.numel() else 0.0
    err = score_error(q, k, kwargs.get("scale"))
    assert_attention_close(out, lse, ref_out, ref_lse, q.dtype, v_max, err)
    return kernel, splits


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("S", [1, 31, 33, 65, 95])  # S % 32 in {1, 31}, one key
def test_ragged_keys_every_dtype(S, dtype):
    q, k, v = qkv(1, 4, 1, S, 64, Hkv=1, dtype=dtype)
    kernel, _ = check(q, k, v, num_splits=1)
    assert kernel.startswith("steel_attention_decode_vector_")
    if S > 32:
        _, splits = check(q, k, v, num_splits=2, is_causal=True, causal_align="bottom_right")
        assert splits == 2


@pytest.mark.parametrize("group,L", [(1, 1), (1, 8), (4, 1), (4, 2), (8, 1), (2, 3), (1, 5)])
def test_gqa_rows(group, L):
    q, k, v = qkv(1, 2 * group, L, 161, 128, Hkv=2, dtype=torch.float16)
    kernel, _ = check(q, k, v, num_splits=3, is_causal=True, causal_align="bottom_right")
    assert kernel.startswith("steel_attention_decode_vector_")
    check(q, k, v, num_splits=1, sinks=torch.randn(2 * group), softcap=4.0)


@pytest.mark.parametrize("E,Ev", [(40, 40), (96, 96), (192, 128), (256, 256), (576, 512)])
def test_head_dims(E, Ev):
    q, k, v = qkv(1, 4, 1, 97, E, Ev, Hkv=1, dtype=torch.bfloat16)
    kernel, _ = check(q, k, v, num_splits=2)
    assert kernel == f"steel_attention_decode_vector_bf16_e{E}_v{Ev}"


# The kernel's 4 simdgroups are row sets x key sets (params.h steel_attn_decode_vector_row_sets,
# mirrored by timing._decode_vector_row_sets: the fewest whose packed rows fit the register
# budget): at 2 row sets an odd row count leaves set 1 a slot short (the tested slots), at 4 a
# set holds 1 or 2 rows, and 1, 2 or 4 key sets meet in the combining rounds. f16, the packing
# fixed (decode_heads_per_tg) so that the packed rows are group x L.
@pytest.mark.parametrize(
    "E,group,L,row_sets",
    [(32, 1, 3, 2), (32, 3, 1, 2), (40, 5, 1, 4), (64, 1, 1, 1), (128, 1, 3, 1), (512, 1, 7, 4),
     (512, 2, 2, 2)],
)  # fmt: skip
def test_row_and_key_sets(E, group, L, row_sets):
    assert timing._decode_vector_row_sets(E, E, 2, group * L) == row_sets
    q, k, v = qkv(1, 2 * group, L, 95, E, Hkv=2, dtype=torch.float16)
    kernel, _ = check(q, k, v, num_splits=1, heads=group, is_causal=True,
                      causal_align="bottom_right")  # fmt: skip
    assert kernel == f"steel_attention_decode_vector_f16_e{E}_v{E}"
    check(q, k, v, num_splits=2, heads=group, sinks=torch.randn(2 * group))


# The one-pass wide blocks (decode_plan.cpp decode_simdgroups): 8 or 16 simdgroups are 2 or 4
# times the key sets over the same tiles (f16 d128: 8 or 16 key sets of 4 or 2 keys a tile;
# d64, d256: 2 row sets x 4 or 8), only the first 4 simdgroups loading the tiles, and the key
# sets meet in steps of the slots the tile memory holds (d128: 4 of the 8 writers of a 16-wide
# block's first round). Ragged keys (S % 32 in {1, 31}, one key: key sets with no key), every
# dtype, GQA rows and the row sets' tested slots, causal, sinks, softcap, and a wide split.
@pytest.mark.parametrize("width", [8, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("S", [1, 31, 65])
def test_wide_blocks_ragged_every_dtype(width, dtype, S):
    q, k, v = qkv(1, 1, 1, S, 128, Hkv=1, dtype=dtype)
    kernel, splits = check(q, k, v, num_splits=1, width=width)
    assert kernel.startswith("steel_attention_decode_vector_") and splits == 1
    q, k, v = qkv(1, 4, 1, S, 64, Hkv=1, dtype=dtype)
    check(q, k, v, num_splits=1, width=width, is_causal=True, causal_align="bottom_right")


@pytest.mark.parametrize("width", [8, 16])
@pytest.mark.parametrize("E", [64, 128, 256])
@pytest.mark.parametrize("group,L", [(1, 3), (3, 1), (8, 1)])
def test_wide_blocks_rows_and_options(width, E, group, L):
    q, k, v = qkv(1, 2 * group, L, 161, E, Hkv=2, dtype=torch.float16)
    check(q, k, v, num_splits=1, width=width, sinks=torch.randn(2 * group), softcap=4.0)
    _, splits = check(q, k, v, num_splits=2, width=width, is_causal=True,
                      causal_align="bottom_right")  # fmt: skip
    assert splits == 2


# GQA packing (decode_plan.cpp decode_layout_time: fewer heads a threadgroup where more
# threadgroups fill the cores): every forced packing of a group of 4 or 8, 1, 2 and the whole
# group, each threadgroup's heads h0 .. h0 + heads - 1 of its KV head (decode.h's init), ragged
# keys, every dtype, one pass and split, with per-head sinks (a wrong head reads another's).
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [4, 8])
@pytest.mark.parametrize("S", [33, 95])  # S % 32 in {1, 31}
@pytest.mark.parametrize("heads", [1, 2, "group"])
def test_forced_gqa_packing(dtype, group, S, heads):
    heads = group if heads == "group" else heads
    q, k, v = qkv(2, 2 * group, 1, S, 128, Hkv=2, dtype=dtype)
    kernel, splits = check(q, k, v, num_splits=1, heads=heads)
    assert kernel.startswith("steel_attention_decode_vector_") and splits == 1
    _, splits = check(q, k, v, num_splits=2, heads=heads, sinks=torch.randn(2 * group),
                      is_causal=True, causal_align="bottom_right")  # fmt: skip
    assert splits == 2


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_forced_gqa_packing_rows_and_row_sets(heads):
    """Two query rows a head (packed rows heads x 2) at d64's 2 row sets, and a wide block."""
    q, k, v = qkv(1, 8, 2, 65, 64, Hkv=2, dtype=torch.float16)
    check(q, k, v, num_splits=1, heads=heads, is_causal=True, causal_align="bottom_right")
    check(q, k, v, num_splits=1, heads=heads, width=8, softcap=4.0)


def test_strided_views_and_masks():
    """A slice of a longer [B, S, H, D] cache, a bool mask and an additive float mask."""
    gen = torch.Generator().manual_seed(5)
    q = rand(2, 1, 8, 64, dtype=torch.float16, gen=gen).transpose(1, 2)
    cache = rand(2, 300, 2, 64, dtype=torch.float16, gen=gen)
    k = cache[:, :257].transpose(1, 2)
    v = rand(2, 257, 2, 64, dtype=torch.float16, gen=gen).transpose(1, 2)
    kernel, _ = check(q, k, v, num_splits=2)
    assert kernel.startswith("steel_attention_decode_vector_")
    check(q, k, v, torch.rand(1, 257, generator=gen) > 0.4, num_splits=1)
    check(q, k, v, torch.randn(2, 8, 1, 257, generator=gen), num_splits=3, window=(100, 0))
    check(q, k, v, torch.rand(1, 257, generator=gen) > 0.4, num_splits=1, width=8)


# Direct reads (decode_plan.cpp decode_direct): the key sets take whole tiles, each key row read
# from the device. Taken for dense and varlen K/V in the compute dtype at one row set (params.h
# steel_attn_decode_vector_row_sets: the fewest whose packed rows fit the register budget; one
# packed row is one row set at every head dim, eight are at d96 and d128 in every dtype and at
# d32 to d72 in float32).


@pytest.mark.parametrize("direct", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("S", [1, 31, 65, 95])  # S % 32 in {1, 31}, one key
@pytest.mark.parametrize("width", [4, 16])
def test_direct_reads_ragged_every_dtype(direct, dtype, S, width):
    """Ragged key counts, more key sets than tiles (16 simdgroups over 1 to 3 tiles), split-K,
    bottom-right causal, GQA 4 packed: both ways of reading the tiles."""
    q, k, v = qkv(1, 4, 1, S, 128, Hkv=1, dtype=dtype)
    check(q, k, v, num_splits=1, width=width, direct=direct)
    if S > 32:
        check(q, k, v, num_splits=2, direct=direct, is_causal=True, causal_align="bottom_right")


@pytest.mark.parametrize("direct", [0, 1])
@pytest.mark.parametrize("E,Ev", [(128, 128), (100, 120), (127, 128)])
def test_direct_reads_views_masks_and_options(direct, E, Ev):
    """Head dims below the instantiation's (bounds on every column, no vector loads), K and V
    views of a longer [B, S, H, D] cache at odd storage offsets (rows not 16-byte aligned), a
    bool and an additive mask, a window, sinks and softcap, two query rows of two heads."""
    gen = torch.Generator().manual_seed(21)
    q = rand(2, 4, 2, E, dtype=torch.float32, gen=gen)
    k_cache = rand(2 * 300 * 2 * E + 3, dtype=torch.float32, gen=gen)
    k = k_cache[3:].view(2, 300, 2, E)[:, :161].transpose(1, 2)
    v = rand(2, 161, 2, Ev + 1, dtype=torch.float32, gen=gen)[..., 1:].transpose(1, 2)
    sinks = rand(4, dtype=torch.float32, gen=gen)
    bool_mask = torch.rand(2, 1, 1, 161, generator=gen) > 0.3
    check(q, k, v, bool_mask, num_splits=1, direct=direct, sinks=sinks, softcap=5.0)
    check(q, k, v, torch.randn(2, 4, 2, 161, generator=gen), num_splits=2, width=4,
          direct=direct, window=(70, 0), is_causal=True, causal_align="bottom_right")  # fmt: skip
    check(q, k, v, None, num_splits=1, width=16, direct=direct, window=(40, 3))


@pytest.mark.parametrize("direct", [0, 1])
def test_direct_reads_packed_varlen(direct):
    """Packed sequences (cu_seqlens_k): each sequence's keys start at its own row of K and V."""
    gen = torch.Generator().manual_seed(23)
    lq, lk = [1, 2, 0, 1], [300, 17, 4, 33]
    q = rand(sum(lq), 4, 128, dtype=torch.float16, gen=gen)
    k = rand(sum(lk), 2, 128, dtype=torch.float16, gen=gen)
    v = rand(sum(lk), 2, 128, dtype=torch.float16, gen=gen)
    tensors = [q, k, v, _cu(lq), _cu(lk), None]
    options = {"max_seqlen_q": 2, "max_seqlen_k": 300, "scale": 0.125, "is_causal": True,
               "bottom_right": True, "decode_direct": direct}  # fmt: skip
    p = sim.plan("sdpa_varlen", tensors, options)
    assert p.dispatches[0].kernel == "steel_attention_decode_vector_f16_e128_v128"
    assert p.dispatches[0].constants[FC_DECODE_DIRECT] == bool(direct)
    out, lse = sim.run_op("sdpa_varlen", tensors, options, checkers=True)[:2]
    with torch_steel.backend("reference"):
        ref_out, ref_lse = torch_steel.sdpa_varlen(
            q.double(), k.double(), v.double(), _cu(lq), _cu(lk), 2, 300, scale=0.125,
            is_causal=True, causal_align="bottom_right", return_lse=True)  # fmt: skip
    assert_attention_close(out, lse, ref_out, ref_lse, q.dtype, 4.0 * 1.5, 1e-5)


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


@pytest.mark.parametrize(
    "dtype,E",
    [(torch.float32, 40), (torch.float32, 64), (torch.float32, 72), (torch.float16, 96),
     (torch.bfloat16, 96), (torch.float16, 64)],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("width", [4, 8])
def test_direct_reads_head_dims(dtype, E, width):
    """Direct reads at the other head dims they serve: d40 and d72 (columns past the lanes'
    whole chunks, bounded at D), d64 (two-element vector loads), d96; GQA 2 at 2 packed rows."""
    q, k, v = qkv(1, 2, 1, 77, E, Hkv=1, dtype=dtype)
    check(q, k, v, num_splits=1, width=width, direct=1, is_causal=True,
          causal_align="bottom_right")  # fmt: skip


def test_direct_reads_aligned_cache_views():
    """K and V slices of longer [B, S, H, D] caches whose rows start 16-byte aligned: vector
    loads from strided rows."""
    gen = torch.Generator().manual_seed(22)
    q = rand(2, 4, 1, 128, dtype=torch.float16, gen=gen)
    k = rand(2, 400, 2, 128, dtype=torch.float16, gen=gen)[:, 8:181].transpose(1, 2)
    v = rand(2, 400, 2, 128, dtype=torch.float16, gen=gen)[:, 16:189].transpose(1, 2)
    check(q, k, v, num_splits=1, direct=1)
    check(q, k, v, torch.rand(2, 1, 1, 173, generator=gen) > 0.2, num_splits=2, direct=1)


def test_paged_caches_keep_staged_tiles():
    """A paged cache's rows are found through the block table by the tile loader: no direct
    reads."""
    q = torch.zeros(2, 4, 128, dtype=torch.float16)
    pool = torch.zeros(4, 16, 2, 128, dtype=torch.float16)
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    used = torch.tensor([20, 32], dtype=torch.int32)
    p = sim.plan("sdpa_varlen", [q, pool, pool, cu_q, None, None, table, used],
                 {"max_seqlen_q": 1, "max_seqlen_k": 32, "scale": 0.125})  # fmt: skip
    assert p.dispatches[0].kernel == "steel_attention_decode_vector_f16_e128_v128"
    assert p.dispatches[0].constants[FC_DECODE_DIRECT] is False


@pytest.mark.parametrize("group,direct", [(1, True), (4, True), (8, False)])
def test_direct_reads_where_one_row_set_holds_the_rows(group, direct):
    """d64 float16: up to four packed rows are one row set, read directly; eight are two row
    sets, which would read each row twice, so the tiles stay staged."""
    q, k, v = qkv(1, group, 1, 100, 64, Hkv=1, dtype=torch.float16)
    inputs, _ = ops.attention_ops._sdpa_inputs(q, k, v, None, 0.0, False, None, True, None, None,
                                               None, "top_left", None, 0)  # fmt: skip
    options = {**ops.Attn(*inputs[4:]).run_options(), "decode_heads_per_tg": group}
    p = sim.plan("sdpa", [*inputs[:4], None], options)
    assert p.dispatches[0].kernel.startswith("steel_attention_decode_vector_")
    assert timing._decode_vector_row_sets(64, 64, 2, group) == (1 if direct else 2)
    assert p.dispatches[0].constants[FC_DECODE_DIRECT] is direct
    check(q, k, v, num_splits=1, heads=group)


CHOICES = [(1, 1, True), (4, 2, True), (8, 1, True), (8, 2, False), (4, 3, False), (1, 9, False)]


@pytest.mark.parametrize("group,L,vector", CHOICES)
def test_plan_choice(group, L, vector):
    """By default vector while the group's rows fit 8 (one threadgroup per KV head still), the
    MMA kernel beyond (and L > 8 is not decode's at all, on a dense call)."""
    q, k, v = qkv(1, group, L, 64, 64, Hkv=1, dtype=torch.float16)
    inputs, _ = ops.attention_ops._sdpa_inputs(q, k, v, None, 0.0, False, None, True, None, None,
                                               None, "top_left", None, 0)  # fmt: skip
    attn = ops.Attn(*inputs[4:])
    kernel = sim.plan("sdpa", [*inputs[:4], None], attn.run_options()).dispatches[0].kernel
    assert kernel.startswith("steel_attention_decode_vector_") == vector, kernel
    off = sim.plan("sdpa", [*inputs[:4], None], {**attn.run_options(), "decode_vector": 0})
    assert not off.dispatches[0].kernel.startswith("steel_attention_decode_vector_")


def test_vector_and_mma_agree():
    q, k, v = qkv(1, 8, 1, 200, 128, Hkv=2, dtype=torch.float32)
    a = _run(q, k, v, num_splits=2)
    b = _run(q, k, v, num_splits=2, vector=False)
    assert a[2] != b[2]
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)  # two fp32 summation orders
