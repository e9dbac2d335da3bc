"""The attention decode kernels (shaders/steel/attn/decode.h, plan attention::add_decode) in the
Metal simulator, checkers on, against float64 reference math: dense sdpa with L <= 8, packed
varlen, and the paged KV cache of sdpa_varlen / varlen_attn.

Every call is strict (a refused plan fails the test) and asserts that the decode kernels served
it. One pass and split-K (forced partition counts, and the plan's own choice) are both run, so
the merge sees every option. Tolerances are attn_helpers.assert_attention_close's: out is
accumulated in fp32 and rounded once to its dtype; the split adds one exp per partition and a
sum over at most 32 partitions in fp32 (a few fp32 ulps, inside its 1e-5 absolute term).
"""

from __future__ import annotations

import pytest
import torch
from attn_helpers import (
    DTYPES,
    assert_attention_close,
    oracle,
    qkv,
    rand,
    requires_simulator,
    score_error,
    strict,
)

import torch_steel
from torch_steel import ops, sim

pytestmark = requires_simulator


def _inputs(q, k, v, mask, kwargs):
    inputs, _ = ops.attention_ops._sdpa_inputs(q, k, v, mask, 0.0, kwargs.pop("is_causal", False),
                                 kwargs.pop("scale", None), True, kwargs.pop("sinks", None),
                                 kwargs.pop("softcap", None), kwargs.pop("window", None),
                                 kwargs.pop("causal_align", "top_left"), None, 0)  # fmt: skip
    assert not kwargs, kwargs
    return inputs


def decode(q, k, v, mask=None, num_splits=0, **kwargs):
    """(out, lse, kernels, splits): sdpa_forward on the sim backend with `num_splits`, and the
    plan that served it."""
    inputs = _inputs(q, k, v, mask, dict(kwargs))
    attn = ops.Attn(*inputs[4:])._replace(num_splits=num_splits)
    p = sim.plan("sdpa", [*inputs[:4], attn.sinks], attn.run_options())
    kernels = [d.kernel for d in p.dispatches]
    assert kernels and kernels[0].startswith("steel_attention_decode_"), (p.reason, kernels)
    with strict(), torch_steel.backend("sim"):
        out, lse = torch.ops.steel.sdpa_forward(*inputs[:4], *attn)
    return out, lse, kernels, p.dispatches[0].grid[0]


def check_decode(q, k, v, mask=None, num_splits=0, **kwargs):
    out, lse, kernels, splits = decode(q, k, v, mask, num_splits, **kwargs)
    ref_out, ref_lse = oracle(q, k, v, mask, enable_gqa=True, **kwargs)
    v_max = float(v.double().abs().max()) if v.numel() else 0.0
    err = score_error(q, k, kwargs.get("scale"))
    assert_attention_close(out, lse, ref_out, ref_lse, q.dtype, v_max, err)
    return out, lse, splits


SAMPLE_DIMS = [(64, 64), (128, 128), (192, 128), (40, 40)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E,Ev", SAMPLE_DIMS)
def test_head_dims_and_dtypes_one_pass_and_split(E, Ev, dtype):
    q, k, v = qkv(2, 8, 2, 300, E, Ev, Hkv=2, dtype=dtype)
    _, _, splits = check_decode(q, k, v, num_splits=3)
    assert splits == 3
    _, _, splits = check_decode(q, k, v, num_splits=1)
    assert splits == 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "E,Ev", [(32, 32), (40, 40), (64, 64), (72, 72), (80, 80), (96, 96), (128, 128), (160, 160),
             (192, 128), (192, 192), (256, 256), (512, 512), (48, 80), (100, 100)],
)  # fmt: skip
def test_every_instantiation(E, Ev, dtype):
    q, k, v = qkv(1, 4, 3, 200, E, Ev, Hkv=1, dtype=dtype)
    check_decode(q, k, v, num_splits=2, is_causal=True, causal_align="bottom_right")
    check_decode(q, k, v, num_splits=1, sinks=torch.randn(4))


@pytest.mark.parametrize("group,L", [(1, 1), (1, 8), (4, 1), (4, 5), (8, 4), (8, 8)])
def test_gqa_packing(group, L):
    """group * L > 32 (8 x 8, and 4 heads of 5 rows out of 8 x 5) splits the group over several
    threadgroups; the rest packs the whole group in one."""
    q, k, v = qkv(1, 2 * group, L, 150, 64, Hkv=2, dtype=torch.float16)
    check_decode(q, k, v, num_splits=2, is_causal=True, causal_align="bottom_right")


@pytest.mark.parametrize("S", [1, 7, 33, 256, 1000, 2500])
def test_kv_lengths_auto_splits(S):
    """The plan's own partition count and a forced one. The plan's count is the timing model's
    pick (tests/plan/test_decode_plan.py restates it): here one pass of 16-simdgroup blocks up
    to S = 1000 (direct reads), 10 partitions at 2500; at most one a 256 keys."""
    q, k, v = qkv(1, 4, 2, S, 64, Hkv=1, dtype=torch.float16)
    _, _, splits = check_decode(q, k, v)
    assert 1 <= splits <= -(-S // 256), splits
    assert splits == (10 if S == 2500 else 1), splits
    if S > 1:
        check_decode(q, k, v, num_splits=5, window=(S // 3, 0), causal_align="bottom_right")


MASKS = {
    "bool_LS": lambda B, H, L, S, g: torch.rand(L, S, generator=g) > 0.3,
    "same_B1LS": lambda B, H, L, S, g: torch.randn(B, 1, L, S, generator=g),
    "float32_1H1S": lambda B, H, L, S, g: torch.randn(1, H, 1, S, generator=g),
    "bool_BHLS": lambda B, H, L, S, g: torch.rand(B, H, L, S, generator=g) > 0.5,
}


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("kind", list(MASKS))
def test_masks(kind, num_splits):
    B, H, L, S = 2, 4, 3, 200
    q, k, v = qkv(B, H, L, S, 64, Hkv=1, dtype=torch.bfloat16)
    mask = MASKS[kind](B, H, L, S, torch.Generator().manual_seed(1))
    if kind.startswith("same"):
        mask = mask.to(torch.bfloat16)
    check_decode(q, k, v, mask, num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize(
    "options",
    [{"is_causal": True}, {"is_causal": True, "causal_align": "bottom_right"},
     {"window": (40, 0), "causal_align": "bottom_right"}, {"window": (5, 9)},
     {"softcap": 3.0}, {"sinks": "T"}, {"sinks": "float32"}, {"scale": 0.3},
     {"softcap": 5.0, "is_causal": True, "causal_align": "bottom_right", "sinks": "float32",
      "window": (100, 0)}],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)  # fmt: skip
def test_options(options, num_splits):
    q, k, v = qkv(1, 4, 4, 260, 64, Hkv=2, dtype=torch.float16)
    options = dict(options)
    if "sinks" in options:
        dtype = torch.float16 if options["sinks"] == "T" else torch.float32
        options["sinks"] = rand(4, dtype=dtype, gen=torch.Generator().manual_seed(2), scale=3.0)
    check_decode(q, k, v, None, num_splits, **options)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_rows_that_see_nothing_and_padding_masks(num_splits):
    """A row whose keys are all masked gives 0 and lse -inf (with a sink: lse = the sink), in
    every partition; a finfo.min padding mask over all of a row's keys gives the uniform mean
    (the merge weighs partitions by their max in nats, not by a rounded lse)."""
    q, k, v = qkv(1, 2, 2, 100, 64, Hkv=1, dtype=torch.float32)
    keep = torch.ones(2, 100, dtype=torch.bool)
    keep[1] = False
    out, lse, _ = check_decode(q, k, v, keep, num_splits)
    assert bool((out[:, :, 1] == 0).all()) and bool(lse[:, :, 1].isneginf().all())
    sinks = torch.tensor([0.5, -1.0])
    _, lse, _ = check_decode(q, k, v, keep, num_splits, sinks=sinks)
    assert torch.allclose(lse[0, :, 1], sinks)
    pad = torch.zeros(2, 100)
    pad[1] = torch.finfo(torch.float32).min
    out, _, _ = check_decode(q, k, v, pad, num_splits)
    torch.testing.assert_close(out[0, 0, 1], v[0, 0].mean(0), atol=1e-5, rtol=0)


def test_batch_and_strided_layouts():
    """A [B, L, H, E] cache view and a broadcast batch dim: the dense plan's strides."""
    gen = torch.Generator().manual_seed(4)
    q = rand(2, 3, 8, 64, dtype=torch.float16, gen=gen).transpose(1, 2)  # BLHD
    cache = rand(2, 400, 2, 64, dtype=torch.float16, gen=gen)
    k = cache[:, :333].transpose(1, 2)  # a slice of a longer cache
    v = rand(2, 333, 2, 64, dtype=torch.float16, gen=gen).transpose(1, 2)
    check_decode(q, k, v, num_splits=4, is_causal=True, causal_align="bottom_right")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_a_cache_grown_by_cat(dtype):
    """A KV cache grown by torch.cat, one token per step (HF's DynamicCache), GQA, batch 2: one
    plan family for every length (its key and value strides rewritten with S, plan_cache.h),
    each step's result the oracle's. Lengths cross the key tile and a split count change."""
    gen = torch.Generator().manual_seed(9)
    k = rand(2, 2, 30, 64, dtype=dtype, gen=gen)
    v = rand(2, 2, 30, 64, dtype=dtype, gen=gen)
    for step in range(5):
        q = rand(2, 4, 1, 64, dtype=dtype, gen=gen)
        check_decode(q, k, v, is_causal=True, causal_align="bottom_right")
        new = [rand(2, 2, 1 + 17 * (step == 2), 64, dtype=dtype, gen=gen) for _ in range(2)]
        k, v = torch.cat([k, new[0]], dim=-2), torch.cat([v, new[1]], dim=-2)
        assert k.is_contiguous()


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float16], ids=str)
def test_batched_decode_with_a_padding_mask(mask_dtype):
    """Batched generation as HF runs it: left-padded prompts, a [B, 1, 1, S] padding mask made
    anew each step (row-major, so its strides hold S) and a KV cache grown by torch.cat: one
    plan family for every length (plan_cache.h), each step the oracle's."""
    gen = torch.Generator().manual_seed(10)
    dtype = torch.float16
    k, v = (rand(3, 2, 20, 64, dtype=dtype, gen=gen) for _ in range(2))
    pad = torch.tensor([0, 5, 11])  # left padding of each sequence
    for _ in range(4):
        q = rand(3, 4, 1, 64, dtype=dtype, gen=gen)
        keep = torch.arange(k.shape[-2])[None, :] >= pad[:, None]  # [B, S]
        mask = keep if mask_dtype == torch.bool else torch.zeros(keep.shape, dtype=mask_dtype)
        if mask_dtype != torch.bool:
            mask.masked_fill_(~keep, float("-inf"))
        check_decode(q, k, v, mask[:, None, None, :].contiguous())
        k, v = (torch.cat([t, rand(3, 2, 1, 64, dtype=dtype, gen=gen)], dim=-2) for t in (k, v))


# ---------------------------------------------------------------- varlen and the paged cache


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def paged_cache(used, page_size, Hkv, E, dtype, gen, spare=3):
    """Pools holding the sequences' keys in shuffled pages (plus `spare` unused pages), and the
    block table (unused columns -1, as vLLM pads them)."""
    need = [-(-n // page_size) for n in used]
    pages = sum(need) + spare
    k_pool = rand(pages, page_size, Hkv, E, dtype=dtype, gen=gen)
    v_pool = rand(pages, page_size, Hkv, E, dtype=dtype, gen=gen)
    order = torch.randperm(pages, generator=gen).tolist()
    table = torch.full((len(used), max(max(need), 1)), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(order[at : at + n], dtype=torch.int32)
        at += n
    return k_pool, v_pool, table


def by_hand(pool, table, b, n):
    """Sequence b's keys gathered from its pages: [1, Hkv, n, E] (the test's own gather)."""
    rows = [pool[int(table[b, j // pool.shape[1]]), j % pool.shape[1]] for j in range(n)]
    out = torch.stack(rows) if rows else pool.new_empty(0, *pool.shape[2:])
    return out.transpose(0, 1).unsqueeze(0)


def paged(q, k_pool, v_pool, lq, used, table, num_splits=None, **kwargs):
    with strict(), torch_steel.backend("sim"):
        return torch_steel.sdpa_varlen(q, k_pool, v_pool, cu(lq), None, max(lq), max(used),
                                       block_table=table, num_splits=num_splits,
                                       seqused_k=torch.tensor(used, dtype=torch.int32),
                                       return_lse=True, **kwargs)  # fmt: skip


def paged_oracle(q, k_pool, v_pool, lq, used, table, **kwargs):
    starts = cu(lq).tolist()
    outs, lses = [], []
    for b, n in enumerate(used):
        qs = q[starts[b] : starts[b + 1]].transpose(0, 1).unsqueeze(0)
        ks, vs = by_hand(k_pool, table, b, n), by_hand(v_pool, table, b, n)
        o, lse = oracle(qs, ks, vs, enable_gqa=True, **kwargs)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def check_paged(q, k_pool, v_pool, lq, used, table, num_splits=None, **kwargs):
    out, lse = paged(q, k_pool, v_pool, lq, used, table, num_splits, **kwargs)
    ref_out, ref_lse = paged_oracle(q, k_pool, v_pool, lq, used, table, **kwargs)
    keys = k_pool.reshape(-1, *k_pool.shape[2:]).transpose(0, 1)
    err = score_error(q.transpose(0, 1), keys, kwargs.get("scale"))
    v_max = float(v_pool.double().abs().max())
    assert_attention_close(out, lse, ref_out, ref_lse, q.dtype, v_max, err)
    return out, lse


@pytest.mark.parametrize(
    "page_size,group,dtype",
    [(16, 1, torch.float16), (16, 4, torch.bfloat16), (16, 8, torch.float32),
     (64, 1, torch.bfloat16), (64, 4, torch.float16), (64, 8, torch.float16)],
    ids=str,
)  # fmt: skip
def test_paged_cache(page_size, group, dtype):
    """Ragged lengths: one key, exactly a page, a page and one, a long sequence, and none."""
    gen = torch.Generator().manual_seed(page_size + group)
    lq, used = [1, 2, 1, 3, 1], [1, page_size, page_size + 1, 1200, 0]
    Hkv = 2
    q = rand(sum(lq), Hkv * group, 64, dtype=dtype, gen=gen)
    k_pool, v_pool, table = paged_cache(used, page_size, Hkv, 64, dtype, gen)
    check_paged(q, k_pool, v_pool, lq, used, table, is_causal=True, causal_align="bottom_right")
    check_paged(q, k_pool, v_pool, lq, used, table, num_splits=1)


@pytest.mark.parametrize(
    "E,dtype,page_size,group",
    [(40, torch.float16, 5, 1), (72, torch.bfloat16, 7, 4), (96, torch.float16, 3, 8),
     (100, torch.float32, 3, 1), (40, torch.float32, 7, 4), (256, torch.float32, 5, 2)],
    ids=str,
)  # fmt: skip
def test_paged_rows_across_simdgroups(E, dtype, page_size, group):
    """The paged loader's shared table entries (loader.h load_paged: lane r of each loading
    simdgroup finds where row r of the key tile lies, once a tile, and each 16-byte chunk takes
    its row's place by a shuffle; decode.h's V tile reuses K's) where a row's chunks are no
    power of two and rows straddle simdgroups (f16 d40: 5 chunks, bf16 d72: 9, f16 d96: 12,
    f32 d40: 10, f32 d256: 64, two simdgroups a row), a head dim below the kernel's (f32 100 on
    128), and pages of a few keys, so that a tile's rows lie in several pages. The plans take
    both kernels: the MMA one (groups 4 and 8) and the vector one at 512 and 256 threads, whose
    simdgroups past the first four load nothing."""
    gen = torch.Generator().manual_seed(E + page_size)
    lq, used = [1, 3, 1], [page_size * 9 + 2, 1, 75]
    Hkv = 2
    q = rand(sum(lq), Hkv * group, E, dtype=dtype, gen=gen)
    k_pool, v_pool, table = paged_cache(used, page_size, Hkv, E, dtype, gen)
    check_paged(q, k_pool, v_pool, lq, used, table, is_causal=True, causal_align="bottom_right")
    check_paged(q, k_pool, v_pool, lq, used, table, num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_options(num_splits):
    gen = torch.Generator().manual_seed(7)
    lq, used = [2, 1, 4], [300, 45, 700]
    q = rand(sum(lq), 8, 128, dtype=torch.bfloat16, gen=gen)
    k_pool, v_pool, table = paged_cache(used, 16, 2, 128, torch.bfloat16, gen)
    sinks = rand(8, dtype=torch.float32, gen=gen)
    check_paged(q, k_pool, v_pool, lq, used, table, num_splits, sinks=sinks, softcap=4.0,
                window=(50, 0), causal_align="bottom_right")  # fmt: skip


@pytest.mark.parametrize("num_splits", [None, 2])
def test_paged_chunked_prefill(num_splits):
    """More than 8 query rows per sequence over a paged cache (chunked prefill): the decode
    kernel in blocks of 32 rows of one head, causal aligned bottom-right."""
    gen = torch.Generator().manual_seed(12)
    lq, used = [40, 1, 70], [300, 33, 70]
    q = rand(sum(lq), 4, 64, dtype=torch.float16, gen=gen)
    k_pool, v_pool, table = paged_cache(used, 16, 2, 64, torch.float16, gen)
    sinks = rand(4, dtype=torch.float32, gen=gen)
    check_paged(q, k_pool, v_pool, lq, used, table, num_splits, is_causal=True,
                causal_align="bottom_right", sinks=sinks)  # fmt: skip


def test_packed_varlen_decode():
    """Packed keys (cu_seqlens_k) with few query rows take the decode kernels too."""
    gen = torch.Generator().manual_seed(8)
    lq, lk = [1, 3, 0, 8], [500, 17, 4, 1]
    q = rand(sum(lq), 4, 64, dtype=torch.float16, gen=gen)
    k = rand(sum(lk), 2, 64, dtype=torch.float16, gen=gen)
    v = rand(sum(lk), 2, 64, dtype=torch.float16, gen=gen)
    p = sim.plan("sdpa_varlen", [q, k, v, cu(lq), cu(lk), None],
                 {"max_seqlen_q": 8, "max_seqlen_k": 500, "scale": 0.125})  # fmt: skip
    assert [d.kernel for d in p.dispatches] == [
        "steel_attention_decode_f16_e64_v64", "steel_attention_decode_merge_f16"]  # fmt: skip
    for splits in (None, 1):
        with strict(), torch_steel.backend("sim"):
            out, lse = torch_steel.sdpa_varlen(q, k, v, cu(lq), cu(lk), 8, 500, is_causal=True,
                                               causal_align="bottom_right", num_splits=splits,
                                               return_lse=True)  # fmt: skip
        with torch_steel.backend("reference"):
            ref_out, ref_lse = torch_steel.sdpa_varlen(q.double(), k.double(), v.double(),
                                                       cu(lq), cu(lk), 8, 500, is_causal=True,
                                                       causal_align="bottom_right",
                                                       return_lse=True)  # fmt: skip
        assert_attention_close(out, lse, ref_out, ref_lse, q.dtype, 4.0 * 1.5, 1e-5)


def test_batch_invariance_with_one_split():
    """num_splits=1: a sequence's output is bitwise the same alone and inside a batch whose
    other sequences change the plan's partition count (paged and packed)."""
    gen = torch.Generator().manual_seed(9)
    lq, used = [1, 2, 1], [900, 70, 2000]
    q = rand(sum(lq), 4, 64, dtype=torch.float16, gen=gen)
    k_pool, v_pool, table = paged_cache(used, 16, 1, 64, torch.float16, gen)
    together, lse_t = paged(q, k_pool, v_pool, lq, used, table, num_splits=1)
    alone, lse_a = paged(q[1:3], k_pool, v_pool, [2], [70], table[1:2], num_splits=1)
    assert torch.equal(together[1:3], alone) and torch.equal(lse_t[:, 1:3], lse_a)
    # The plan's own choice splits the batch differently from the single sequence; the kernels
    # still agree with the reference either way (checked above), but not bit for bit.
    k = by_hand(k_pool, table, 1, 70)[0].transpose(0, 1).contiguous()
    v = by_hand(v_pool, table, 1, 70)[0].transpose(0, 1).contiguous()
    with strict(), torch_steel.backend("sim"):
        packed_alone = torch_steel.sdpa_varlen(q[1:3], k, v, cu([2]), cu([70]), 2, 70,
                                               num_splits=1)  # fmt: skip
    assert torch.equal(packed_alone, alone)


def test_paged_validation_errors():
    gen = torch.Generator().manual_seed(10)
    q = rand(2, 2, 32, dtype=torch.float16, gen=gen)
    k_pool, v_pool, table = paged_cache([20, 5], 16, 2, 32, torch.float16, gen, spare=0)
    seq = torch.tensor([20, 5], dtype=torch.int32)

    def call(k=k_pool, cu_k=None, **kw):
        args = {"block_table": table, "seqused_k": seq, **kw}
        with torch_steel.backend("sim"):
            torch_steel.sdpa_varlen(q, k, v_pool, cu([1, 1]), cu_k, 1, 64, **args)

    bad = table.clone()
    bad[0, 1] = 3  # the pool has 3 pages: 0, 1, 2
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 3 is not a page of the pool"):
        call(block_table=bad)
    with pytest.raises(ValueError, match=r"seqused_k\[0\] = 40 keys, but the block table covers"):
        call(seqused_k=torch.tensor([40, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table must be an int32 tensor"):
        call(block_table=table.long())
    with pytest.raises(ValueError, match="seqused_k must be an int32 tensor of rank 1"):
        call(seqused_k=seq.float())
    with pytest.raises(ValueError, match="a paged key must be a pool"):
        call(k=k_pool.reshape(-1, 2, 32))
    with pytest.raises(ValueError, match="cu_seqlens_k=None"):
        call(cu_k=cu([20, 5]))
    with pytest.raises(ValueError, match="block_table has 2 rows"):
        call(seqused_k=seq[:1])


def test_kernel_clamps_a_corrupt_table():
    """Past the Python checks (sim.run_op straight on the plan): pages out of the pool and
    seqused_k beyond the table are clamped by the kernel; the checkers see no access outside
    the pool or the table."""
    gen = torch.Generator().manual_seed(11)
    q = rand(2, 2, 32, dtype=torch.float32, gen=gen)
    k_pool, v_pool, _ = paged_cache([30], 16, 2, 32, torch.float32, gen, spare=0)
    table = torch.tensor([[1, 99], [-5, 0]], dtype=torch.int32)
    seq = torch.tensor([1000, 20], dtype=torch.int32)
    opts = {"max_seqlen_q": 1, "max_seqlen_k": 32, "scale": 0.2, "num_splits": 2}
    out, lse = sim.run_op("sdpa_varlen", [q, k_pool, v_pool, cu([1, 1]), None, None, table, seq],
                          opts, checkers=True)  # fmt: skip
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
