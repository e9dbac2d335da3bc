"""The traffic model of bench/bench_attention.py against the simulator's counters: the bytes each
buffer of an attention plan moves and its MMAs, predicted from the plan alone, must equal what the
simulator counts; causal plans visit about half the key tiles, and no plan allocates anything
besides out and lse (no L x S intermediate)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from attn_helpers import requires_simulator

from torch_steel import sim

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_attention  # noqa: E402

pytestmark = requires_simulator


@pytest.mark.parametrize(
    "B,Hq,Hkv,L,S,E,Ev,options,mask_shape,sinks",
    [
        (1, 2, 2, 33, 47, 64, 64, {}, None, False),
        (2, 4, 2, 70, 100, 40, 40, {"is_causal": True}, (70, 100), True),
        (1, 2, 1, 50, 30, 96, 96, {"is_causal": True, "bottom_right": True}, (1, 2, 1, 30), False),
        (1, 1, 1, 64, 200, 256, 256, {"window_left": 20, "window_right": 5}, None, True),
        (1, 2, 2, 9, 17, 192, 128, {}, (1, 2, 9, 17), False),
    ],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_traffic_model_matches_counters(B, Hq, Hkv, L, S, E, Ev, options, mask_shape, sinks,
                                        dtype):  # fmt: skip
    q, k, v, mask = bench_attention.inputs(B, Hq, Hkv, L, S, E, Ev, mask_shape, dtype, "cpu")
    s = torch.randn(Hq, dtype=dtype) if sinks else None
    opts = bench_attention.run_options(E, options)
    p = sim.plan("sdpa", [q, k, v, mask, s], opts)
    es = torch.finfo(dtype).bits // 8
    predicted, mma, _, _ = bench_attention.model(p, B, es, 1, es)
    _, counters = sim.run_op("sdpa", [q, k, v, mask, s], opts, counters=True, checkers=False)
    assert bench_attention.counted(counters) == predicted
    assert counters[0]["mma"] == mma


def test_causal_visits_about_half_the_tiles_and_allocates_no_score_matrix():
    q, k, v, _ = bench_attention.inputs(1, 8, 8, 4096, 4096, 128, 128, None, torch.float16,
                                        "meta")  # fmt: skip
    p = sim.plan("sdpa", [q, k, v, None, None], bench_attention.run_options(128, {"is_causal": 1}))
    _, _, tiles, dense = bench_attention.model(p, 1, 2, 1, 0)
    assert 0.5 <= tiles / dense < 0.51
    assert [a.name for a in p.allocations] == ["out", "lse"]


@pytest.mark.parametrize(
    "lq,lk,Hq,Hkv,options",
    [
        ([1, 7, 100, 0, 33], [1, 7, 100, 4, 0], 2, 2, {}),
        ([40, 0, 70], [100, 5, 30], 4, 2, {"is_causal": True, "bottom_right": True}),
        ([64, 9], [64, 90], 2, 1, {"window_left": 10, "window_right": 3}),
    ],
)  # fmt: skip
def test_varlen_traffic_model_matches_counters(lq, lk, Hq, Hkv, options):
    """One varlen dispatch: every launched threadgroup reads its cu_seqlens entries, blocks past
    their sequence's end nothing else, the others what a dense block of the sequence reads."""
    tensors = bench_attention.varlen_inputs(lq, lk, Hq, Hkv, 64, torch.float16, "cpu")
    tensors[-1] = torch.randn(Hq, dtype=torch.float32)  # sinks
    opts = {**bench_attention.run_options(64, options), "max_seqlen_q": max(lq),
            "max_seqlen_k": max(lk)}  # fmt: skip
    p = sim.plan("sdpa_varlen", tensors, opts)
    predicted, mma, _, _ = bench_attention.varlen_model(p, lq, lk, 2, 4)
    _, counters = sim.run_op("sdpa_varlen", tensors, opts, counters=True, checkers=False)
    assert bench_attention.counted(counters) == predicted
    assert counters[0]["mma"] == mma


@pytest.mark.parametrize(
    "B,Hq,Hkv,L,S,E,options",
    [
        (1, 2, 2, 33, 47, 64, {}),
        (2, 4, 2, 70, 100, 40, {"is_causal": True}),
        (1, 2, 1, 50, 30, 96, {"is_causal": True, "bottom_right": True, "window_left": 7}),
    ],
)
def test_backward_mma_model_matches_counters(B, Hq, Hkv, L, S, E, options):
    """The backward's MMA model (bench_attention.backward_mma) equals the simulator's count per
    dispatch; the plan's only scratch is the O(L) delta buffer."""
    q, k, v, _ = bench_attention.inputs(B, Hq, Hkv, L, S, E, E, None, torch.float16, "cpu")
    opts = bench_attention.run_options(E, options)
    (out, lse) = sim.run_op("sdpa", [q, k, v, None, None], opts)
    tensors = [torch.randn_like(out), q, k, v, out, lse, None, None, None]
    p = sim.plan("sdpa_backward", tensors, opts)
    _, counters = sim.run_op("sdpa_backward", tensors, opts, counters=True, checkers=False)
    assert [c["mma"] for c in counters] == bench_attention.backward_mma(p, B, 2)
    scratch = [a for a in p.allocations if not a.is_output]
    assert [(a.name, a.sizes) for a in scratch] == [("delta", (2, B * Hq * L))]


@pytest.mark.parametrize(
    "B,Hq,Hkv,L,S,E,options,page,num_splits",
    [
        (2, 4, 1, 3, 300, 64, {"mask": True, "sinks": True}, None, 1),
        (1, 8, 2, 1, 500, 64, {"sinks": True, "is_causal": True, "bottom_right": True}, None, 3),
        (1, 16, 2, 5, 200, 40, {"window_left": 50, "window_right": 0}, None, 2),
        (3, 8, 2, 2, 400, 64, {"sinks": True}, 16, 0),
        (2, 4, 4, 1, 200, 128, {}, 64, 1),
        (2, 4, 2, 40, 300, 64, {"is_causal": True}, 16, 2),  # paged chunked prefill: 2 row blocks
        # Absorbed MLA, 576/512: V the latent's prefix (alias: V's buffer never read, the
        # latent read once), or a copy of it (read again).
        (1, 16, 1, 2, 300, 576, {"mla": "alias", "scale": 0.1}, None, 1),
        (1, 16, 1, 1, 200, 576, {"mla": "copy", "sinks": True}, None, 2),
        (2, 16, 1, 1, 150, 576, {"mla": "alias", "is_causal": True, "bottom_right": True}, 16, 2),
    ],
)  # fmt: skip
def test_decode_traffic_model_matches_counters(B, Hq, Hkv, L, S, E, options, page, num_splits):
    """Every dispatch of a decode plan (partial kernel, merge) moves the bytes and runs the MMAs
    bench_attention.decode_model predicts; K and V are read once per threadgroup of a KV head's
    query heads (GQA packing: once per KV head at the full packing, group / heads_per_tg times
    where the planner packs fewer, decode_plan.cpp decode_layout_time): the bytes read from them
    are the cache's size that many times (decode rows without a window see every key)."""
    tensors, opts, seqs = bench_attention.decode_inputs(B, Hq, Hkv, L, S, E, options, page,
                                                        torch.float16, "cpu")  # fmt: skip
    opts["num_splits"] = num_splits
    op = "sdpa" if page is None else "sdpa_varlen"
    p = sim.plan(op, tensors, opts)
    assert p.dispatches[0].kernel.startswith("steel_attention_decode_")
    models = bench_attention.decode_model(p, seqs, 2, 1, 4)
    assert len(models) == (2 if p.dispatches[0].grid[0] > 1 else 1)
    _, counters = sim.run_op(op, tensors, opts, counters=True, checkers=False)
    assert bench_attention.counted_all(counters) == [b for b, _ in models]
    assert [c["mma"] for c in counters] == [m for _, m in models]
    kv = counters[0]["buffers"][bench_attention.BUF_K]["read"]
    kv += counters[0]["buffers"][bench_attention.BUF_V]["read"]
    # K and V rows; under the alias the latent rows alone (V is their prefix); a copied V adds
    # its 512 columns.
    columns = {None: 2 * E, "alias": E, "copy": E + bench_attention.MLA_EV}[options.get("mla")]
    cache = sum(Hkv * n * columns * 2 for _, n in seqs)
    chunks = Hq // Hkv // bench_attention.decode_params(p.dispatches[0])["heads_per_tg"]
    if L <= 8 and "window_left" not in options:  # one block of rows that see every key
        assert kv == cache * chunks


@pytest.mark.parametrize(
    "B,Hq,Hkv,L,S,E,Ev,options,mask_shape,sinks,mask_grad",
    [
        (1, 2, 2, 33, 47, 64, 64, {}, None, False, False),
        (2, 4, 2, 70, 100, 40, 40, {"is_causal": True}, (70, 100), True, True),
        (1, 2, 1, 50, 30, 96, 96, {"is_causal": True, "bottom_right": True, "window_left": 7},
         (1, 2, 1, 30), False, True),
        (2, 2, 2, 20, 40, 256, 256, {}, (2, 1, 20, 1), True, True),
        (1, 2, 2, 9, 17, 192, 128, {"window_right": 3}, None, False, False),
    ],
)  # fmt: skip
@pytest.mark.parametrize(
    "dtype", [torch.float16, pytest.param(torch.float32, marks=pytest.mark.slow)], ids=str
)
def test_backward_traffic_model_matches_counters(B, Hq, Hkv, L, S, E, Ev, options, mask_shape,
                                                 sinks, mask_grad, dtype):  # fmt: skip
    """Bytes and MMAs of every backward dispatch (bench_attention.backward_model) equal the
    simulator's counters; the only scratch is delta, 2 floats per query row: O(L) memory."""
    check_backward_traffic(B, Hq, Hkv, L, S, E, Ev, options, mask_shape, sinks, mask_grad, dtype)


def test_backward_traffic_float32_head_dim_512():
    """The shared tile buffer of float32 at 512: dK/dV reads each Q tile twice, dQ and dmask
    each K and V tile once; lse, delta and the normaliser once per dK/dV query tile."""
    check_backward_traffic(2, 2, 1, 19, 30, 512, 512, {"is_causal": True}, (2, 1, 19, 30), True,
                           True, torch.float32)  # fmt: skip


def check_backward_traffic(B, Hq, Hkv, L, S, E, Ev, options, mask_shape, sinks, mask_grad, dtype):
    es = torch.finfo(dtype).bits // 8
    q, k, v, _ = bench_attention.inputs(B, Hq, Hkv, L, S, E, Ev, None, dtype, "cpu")
    mask = None if mask_shape is None else torch.randn(mask_shape, dtype=dtype)
    s = torch.randn(Hq, dtype=torch.float32) if sinks else None
    opts = {**bench_attention.run_options(E, options), "mask_grad": mask_grad}
    (out, lse) = sim.run_op("sdpa", [q, k, v, mask, s], opts)
    tensors = [torch.randn_like(out), q, k, v, out, lse, mask, s, torch.randn_like(lse)]
    p = sim.plan("sdpa_backward", tensors, opts)
    predicted = bench_attention.backward_model(p, [(L, S, B)], es, es, 4)
    _, counters = sim.run_op("sdpa_backward", tensors, opts, counters=True, checkers=False)
    assert bench_attention.counted_backward(counters) == [b for b, _ in predicted]
    assert [c["mma"] for c in counters] == [m for _, m in predicted]
    scratch = [a for a in p.allocations if not a.is_output]
    assert [(a.name, a.sizes) for a in scratch] == [("delta", (2, B * Hq * L))]
    if not options:  # every 32-key dK/dV block reads each row's lse, delta, 1 / norm once
        (dkdv,) = [c for c, d in zip(counters, p.dispatches, strict=True) if "dkdv" in d.kernel]
        reads = -(-S // 32) * B * Hq * L * 4
        assert dkdv["buffers"][bench_attention.BUF_FWD_LSE]["read"] == reads
        assert dkdv["buffers"][bench_attention.BUF_DELTA]["read"] == 2 * reads


@pytest.mark.parametrize(
    "lq,lk,Hq,Hkv,options",
    [
        ([1, 7, 100, 0, 33], [1, 7, 100, 4, 0], 2, 2, {}),
        ([40, 0, 70], [100, 5, 30], 4, 2, {"is_causal": True, "bottom_right": True}),
    ],
)  # fmt: skip
def test_varlen_backward_traffic_model_matches_counters(lq, lk, Hq, Hkv, options):
    tensors = bench_attention.varlen_inputs(lq, lk, Hq, Hkv, 64, torch.float16, "cpu")
    tensors[-1] = torch.randn(Hq, dtype=torch.float32)  # sinks
    opts = {**bench_attention.run_options(64, options), "max_seqlen_q": max(lq),
            "max_seqlen_k": max(lk)}  # fmt: skip
    out, lse = sim.run_op("sdpa_varlen", tensors, opts)
    q, k, v, cu_q, cu_k, sinks = tensors
    args = [torch.randn_like(out), q, k, v, out, lse, cu_q, cu_k, sinks, None]
    p = sim.plan("sdpa_varlen_backward", args, opts)
    predicted = bench_attention.backward_model(p, list(zip(lq, lk, [1] * len(lq))), 2, 0, 4)
    _, counters = sim.run_op("sdpa_varlen_backward", args, opts, counters=True, checkers=False)
    assert bench_attention.counted_backward(counters) == [b for b, _ in predicted]
    assert [c["mma"] for c in counters] == [m for _, m in predicted]
