"""Attention benchmark (issue 8, item 12): device traffic and MMAs of the chosen plan against the
minimum, checked against the simulator's counters; on a Mac, steel against F.sdpa on MPS.

For every shape of the table:
  - the plan (torch_steel.sim.plan, the same plan the Mac encodes) and a model of it: the bytes
    each buffer moves, derived from the kernel's tile sizes and its loop bounds (each
    threadgroup reads its BQ query rows once, the K and V rows of every key tile it visits,
    bounded at S and at the head dims; the mask element by element for its rows and visited
    keys; out and lse once), and its simdgroup MMAs;
  - the minimum: q, k, v, the mask once each, out and lse written once; the ideal MMA count
    (the visible (row, key) pairs times (E + Ev), in 8x8x8 units);
  - the fraction of key tiles visited (causal: tends to 1/2);
  - the intermediate memory of the plan (allocations besides out and lse): 0, no L x S buffer;
  - on shapes the simulator runs in seconds (--sim-limit on B*H*L*S*(E+Ev)), the simulator's
    counters next to the model (they must agree exactly; a mismatch fails the run);
  - --device m5 (issue 17) plans the forward and varlen tables for an M5-generation GPU (Metal 4
    matrix units: the matmul2d prefill of shaders/steel/attn_tensor/ for f16 / bf16 at head
    dims 64, 96, 128, 256) and the simulator emulates one: the model then follows that
    kernel's tiles (64 query rows, 32 keys; the operations read each K and V row of a visited
    tile once per block, bounded at S and the head dims, as the loader does), and its MMA
    column counts MMA-equivalents (8x8x8 multiply-adds of the S = Q K^T and O += P V
    operations: 64 x 32 x (DE + DV) per visited tile), checked against the simulator's
    tensor_multiply_adds;
  - varlen (issue 10, item 5): packed batches of ragged sequences as one sdpa_varlen dispatch,
    modelled per sequence (each threadgroup reads its two cu_seqlens entries; blocks past its
    sequence's end read nothing else), against the sum of the sequences' minimums and against
    the dense plan of the same batch padded to the longest sequences;
  - decode (issue 9, item 7): few query rows against a KV cache, dense or paged, through the
    decode kernels: the partitions the plan chose, K and V bytes read against the cache's size
    (GQA packing reads them once per threadgroup of a KV head's query heads: the ratio is ~1 at
    the full packing, group / heads_per_tg where the plan packs fewer), the partials' scratch,
    and the model of every dispatch (partial kernel and merge) against the simulator's counters;
  - the backward (issue 11, item 7): every dispatch's bytes and MMAs (backward_model: the
    delta pre-pass, dK/dV, dQ, and dmask / dsinks when planned) against the minimum (q, k, v,
    grad_out, out, lse read once, dq, dk, dv written once) and the ideal MMAs, checked against
    the simulator; its scratch is delta, 8 bytes per query row: peak memory O(L), never L x S;
  - on a Mac with MPS (--mps): steel.sdpa against F.sdpa, median of --iters runs, and peak
    memory, for B 1..8, H 8..32, L 128..16384, D 64 and 128, causal and not, as a table and
    (with matplotlib) a plot bench/attention_mps.png; decode: tokens per second and time per
    call for KV 1k..32k, B 1..8, H 8..32, D 64/128, GQA 1 and 4 (bench/decode_mps.png); the
    prefill shapes forward + backward against F.sdpa's autograd; and a small GPT's training
    step (6 layers, d_model 512, L 1k..32k) with F.sdpa patched to steel and unpatched, time
    and peak memory.

    python bench/bench_attention.py [--dtype float16] [--sim-limit 3e8] [--mps] [--iters 20]
                                    [--device default|m5]
"""

from __future__ import annotations

import argparse
import itertools
import math
import struct
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_gemm import DEVICES, time_ms  # noqa: E402

from torch_steel import sim  # noqa: E402
from torch_steel.sim import timing  # noqa: E402

BUF_Q, BUF_K, BUF_V, BUF_MASK, BUF_SINKS, BUF_OUT, BUF_LSE, BUF_PARAMS, BUF_CU_Q, BUF_CU_K = range(
    10
)
BUF_BWD_PARAMS = 17
BUF_TABLE, BUF_SEQUSED, BUF_PART_O, BUF_PART_ML = 10, 11, 12, 13
FC_ALIGN_E, FC_ALIGN_EV, FC_VARLEN, FC_SPLIT, FC_PAGED = 302, 303, 316, 322, 323
FC_ALIGN_S, FC_MASK, FC_HAS_HI, FC_HAS_LO, FC_SINKS, FC_VARLEN_BR = 301, 310, 311, 312, 313, 317
FC_KV_ALIAS = 319  # v a prefix view of k: V tiles are the K tiles, v's buffer never read
MLA_E, MLA_EV = 576, 512  # absorbed multi-head latent attention: 512 latent + 64 rotary columns
STEEL_FC_GRAD_LSE = 320
BQ = 32
THREADS = 128
# The delta pre-pass's lanes a row (32 / STEEL_ATTN_DELTA_ROWS_PER_SIMDGROUP): each reads the lse.
DELTA_LANES = 4
# The matmul2d prefill's tiles (STEEL_ATTN_TENSOR_BQ / _BK; 4 simdgroups, THREADS threads).
TENSOR_BQ, TENSOR_BK = 64, 32

# (name, B, Hq, Hkv, L, S, E, Ev, options, mask shape or None)
SHAPES = [
    ("prefill 512 d64", 1, 8, 8, 512, 512, 64, 64, {}, None),
    ("prefill 512 d64 causal", 1, 8, 8, 512, 512, 64, 64, {"is_causal": True}, None),
    ("prefill 2048 d128 causal", 1, 8, 8, 2048, 2048, 128, 128, {"is_causal": True}, None),
    ("prefill 4096 d128 causal", 2, 16, 16, 4096, 4096, 128, 128, {"is_causal": True}, None),
    ("GQA 8/2 1024 d128 causal", 1, 8, 2, 1024, 1024, 128, 128, {"is_causal": True}, None),
    ("SD1.5 4096x77 d40", 2, 8, 8, 4096, 77, 40, 40, {}, None),
    ("SD1.5 1024 d80", 2, 8, 8, 1024, 1024, 80, 80, {}, None),
    ("MLA 192/128 causal", 1, 16, 16, 1024, 1024, 192, 128, {"is_causal": True}, None),
    ("head dim 512 1024 causal", 1, 8, 8, 1024, 1024, 512, 512, {"is_causal": True}, None),
    ("window 4096 (512, 0)", 1, 8, 8, 4096, 4096, 64, 64,
     {"window_left": 512, "window_right": 0}, None),
    ("key padding mask", 2, 8, 8, 256, 256, 64, 64, {}, (2, 1, 1, 256)),
    ("small ragged 33x47 d64", 1, 2, 2, 33, 47, 64, 64, {}, None),
    ("small causal mask 100x257", 1, 2, 1, 100, 257, 96, 96, {"is_causal": True},
     (100, 257)),
]  # fmt: skip


# (name, query lengths, key lengths, Hq, Hkv, E, options) of one packed varlen batch
VARLEN_SHAPES = [
    ("ragged 1,7,100,257,0 d64", [1, 7, 100, 257, 0], [1, 7, 100, 257, 0], 8, 8, 64, {}),
    ("same, causal", [1, 7, 100, 257, 0], [1, 7, 100, 257, 0], 8, 8, 64, {"is_causal": True}),
    ("L != S, causal bottom-right", [1, 7, 100, 257, 0], [100, 7, 33, 300, 5], 8, 2, 64,
     {"is_causal": True, "bottom_right": True}),
    ("8 docs 64..2048 d128 GQA causal", [64, 2048, 300, 1000, 128, 700, 1500, 90],
     [64, 2048, 300, 1000, 128, 700, 1500, 90], 16, 4, 128, {"is_causal": True}),
    ("chunked prefill 4 x 512 on 1k..4k", [512] * 4, [1024, 2048, 3072, 4096], 32, 8, 128,
     {"is_causal": True, "bottom_right": True}),
]  # fmt: skip


def bk_of(de, dv, es):
    """steel_attn_bk (params.h): the key tile of the kernel for head dims (de, dv). One copy of
    the formula, the timing model's (tests/sim/test_timing.py checks its tile bytes against
    every compiled attention kernel)."""
    return timing._attn_bk(de, dv, es)


def params(dispatch, index=BUF_PARAMS):
    """The AttnParams fields the models use (the backward's params start with them, at 17)."""
    raw = next(b.bytes for b in dispatch.bindings if b.index == index)
    L, S, E, Ev, Hq, group, shift, hi_off, lo_off = struct.unpack_from("9i", raw, 0)
    return {"L": L, "S": S, "E": E, "Ev": Ev, "Hq": Hq, "group": group, "shift": shift,
            "hi_off": hi_off, "lo_off": lo_off}  # fmt: skip


def visited_tiles(p, bk, has_hi, has_lo, bq=BQ):
    """[(first row, valid rows, [key tile starts])] per query block, as forward.h bounds them."""
    blocks = []
    for row0 in range(0, p["L"], bq):
        last = min(row0 + bq, p["L"]) - 1
        begin, end = 0, p["S"]
        if has_hi:
            end = min(end, last + p["shift"] + p["hi_off"] + 1)
        if has_lo:
            begin = max(0, row0 + p["shift"] - p["lo_off"])
        t0 = begin // bk
        t1 = -(-end // bk) if end > begin else t0
        blocks.append((row0, last - row0 + 1, [t * bk for t in range(t0, t1)]))
    return blocks


def model(plan, batch, es, mask_es, sinks_es):
    """Predicted {binding: {"read": bytes, "written": bytes}} and MMAs of the one dispatch."""
    d = plan.dispatches[0]
    return block_model(d, params(d), batch * params(d)["Hq"], es, mask_es, sinks_es)


def block_model(d, p, heads, es, mask_es, sinks_es):
    """(buffers, MMAs, key tiles visited, key tiles of a dense walk) of `heads` (batch entry,
    head) pairs of query blocks that attend with the extent p (L, S, shift)."""
    de, dv = (int(x[1:]) for x in d.kernel.split("_")[-2:])
    tensor_ops = d.kernel.startswith("steel_attention_tensor_")
    bq, bk = (TENSOR_BQ, TENSOR_BK) if tensor_ops else (BQ, bk_of(de, dv, es))
    blocks = visited_tiles(p, bk, d.constants[FC_HAS_HI], d.constants[FC_HAS_LO], bq)
    keys = sum(min(bk, p["S"] - k0) for _, _, tiles in blocks for k0 in tiles)
    tiles = sum(len(t) for _, _, t in blocks)
    buffers = {
        BUF_Q: {"read": heads * p["L"] * p["E"] * es, "written": 0},
        BUF_K: {"read": heads * keys * p["E"] * es, "written": 0},
        BUF_V: {"read": heads * keys * p["Ev"] * es, "written": 0},
        BUF_OUT: {"read": 0, "written": heads * p["L"] * p["Ev"] * es},
        BUF_LSE: {"read": 0, "written": heads * p["L"] * 4},
    }
    if d.constants.get(FC_KV_ALIAS):
        del buffers[BUF_V]
    if d.constants[FC_MASK]:
        reads = sum(rows * min(bk, p["S"] - k0) for _, rows, t in blocks for k0 in t)
        buffers[BUF_MASK] = {"read": heads * reads * mask_es, "written": 0}
    if d.constants[FC_SINKS]:
        buffers[BUF_SINKS] = {"read": heads * len(blocks) * THREADS * sinks_es, "written": 0}
    if tensor_ops:  # MMA-equivalents of the two operations of each visited tile
        mma = heads * tiles * bq * bk * (de + dv) // 512
    else:
        frags = sum(
            _prefill_frags(d, p, row0, rows, k0, bk) for row0, rows, t in blocks for k0 in t
        )
        mma = heads * frags * (de // 8 + dv // 8)
    return buffers, mma, tiles, len(blocks) * -(-p["S"] // bk)


def _prefill_frags(d, p, row0, rows, key0, bk):
    """Score fragments the simdgroup prefill multiplies on the key tile from key0, summed over a
    block's simdgroups (forward.h): all of them on an interior tile; on a tile that crosses the
    end of S or a causal / window boundary (attn_edge_tile), each simdgroup only those before
    its last row's limit (attn_visible_frags)."""
    has_hi, has_lo = d.constants[FC_HAS_HI], d.constants[FC_HAS_LO]
    last = row0 + rows - 1
    edge = (
        (not d.constants[FC_ALIGN_S] and key0 + bk > p["S"])
        or (has_hi and key0 + bk - 1 > row0 + p["shift"] + p["hi_off"])
        or (has_lo and key0 < last + p["shift"] - p["lo_off"])
    )
    simdgroups, tk = THREADS // 32, bk // 8
    if not edge:
        return simdgroups * tk
    n = 0
    for sg in range(simdgroups):
        end = p["S"]
        if has_hi:
            end = min(end, row0 + sg * 8 + 7 + p["shift"] + p["hi_off"] + 1)
        n += min(max(int((end - key0 + 7) / 8), 0), tk)  # C's division truncates toward 0
    return n


def varlen_model(plan, lq, lk, es, sinks_es):
    """The one varlen dispatch: each sequence's blocks as a dense block of its own extent, plus
    the cu_seqlens entries every launched threadgroup reads (both per lane, 128 lanes)."""
    d = plan.dispatches[0]
    p = params(d)
    buffers = {BUF_CU_Q: {"read": 0, "written": 0}, BUF_CU_K: {"read": 0, "written": 0}}
    mma = tiles = dense_tiles = 0
    for L, S in zip(lq, lk, strict=True):
        if L:
            shift = S - L if d.constants[FC_VARLEN_BR] else 0
            b, m, t, dt = block_model(d, {**p, "L": L, "S": S, "shift": shift}, p["Hq"], es, 1,
                                      sinks_es)  # fmt: skip
            for i, v in b.items():
                if v["read"] or v["written"]:
                    entry = buffers.setdefault(i, {"read": 0, "written": 0})
                    entry["read"] += v["read"]
                    entry["written"] += v["written"]
            mma, tiles, dense_tiles = mma + m, tiles + t, dense_tiles + dt
    launched = d.grid[0] * d.grid[1] * d.grid[2]
    for i in (BUF_CU_Q, BUF_CU_K):
        buffers[i]["read"] = launched * THREADS * 2 * 4
    return buffers, mma, tiles, max(dense_tiles, 1)


def bwd_tile_of(de, dv, es):
    """(steel_attn_bwd_bk, steel_attn_bwd_shared) of params.h: the rows of the backward's
    streamed tile (the timing model's restatement, which tests/sim/test_timing.py checks against
    params.h), and whether the dK/dV kernel's two tiles take turns in one buffer (no two 8-row
    tiles and their rows' lse, delta and normaliser fit the budget), which makes it read Q
    twice. (The dQ and dmask kernels' shared buffer, steel_attn_bwd_dq_shared, reads each tile
    once all the same.)"""
    return timing._attn_bwd_bk(de, dv, es), timing._attn_bwd_shared(de, dv, es)


# Buffer indices of the backward kernels (params.h).
(BUF_GRAD_OUT, BUF_FWD_OUT, BUF_FWD_LSE, BUF_GRAD_LSE, BUF_DELTA, BUF_DQ, BUF_DK, BUF_DV,
 BUF_DSINKS, _, BUF_DMASK, BUF_BWD_CU_Q, BUF_BWD_CU_K) = range(8, 21)  # fmt: skip
FC_DMASK_ROWS, FC_DMASK_KEYS = 324, 325


def _add(buffers, index, read=0, written=0):
    if read or written:
        entry = buffers.setdefault(index, {"read": 0, "written": 0})
        entry["read"] += read
        entry["written"] += written


def _query_tiles(p, key0, bk, has_hi, has_lo, block=32):
    """[(first row, valid rows)] of the query tiles the dK/dV block of `block` keys at key0
    visits."""
    last_key = min(key0 + block, p["S"]) - 1
    begin, end = 0, p["L"]
    if has_hi:
        begin = max(0, key0 - p["shift"] - p["hi_off"])
    if has_lo:
        end = min(p["L"], last_key - p["shift"] + p["lo_off"] + 1)
    if end <= begin:
        return []
    return [(r, min(bk, p["L"] - r)) for r in range(begin // bk * bk, end, bk)]


def backward_model(plan, extents, es, mask_es=0, sinks_es=0):
    """Predicted ({binding: {"read", "written"}}, MMAs) of each dispatch of an "sdpa_backward" or
    "sdpa_varlen_backward" plan, from backward.h's loops. `extents`: (L, S, count) per batch
    extent, count (batch entry or sequence) repeats of it: [(L, S, B)] dense, [(L_b, S_b, 1)]
    per sequence varlen. Every load is counted as the lanes issue it: a row's lse (and delta and
    1 / normaliser) is read by each lane that needs it (4 per row in dQ and dmask, and the
    pre-pass's DELTA_LANES), or once per query tile by a dK/dV block, which stages them; with shared
    tiles (float32 at 512) the dK/dV kernel reads each Q tile twice; the delta pre-pass's
    normaliser recovery (rows of |lse| >= 4096) is not modelled (the shapes here have none)."""
    results = []
    for d in plan.dispatches:
        p = params(d, BUF_BWD_PARAMS)
        raw = next(b.bytes for b in d.bindings if b.index == BUF_BWD_PARAMS)
        dm_hs, dm_rs, dm_cs = struct.unpack_from("3q", raw, 448)
        (dm_combos,) = struct.unpack_from("i", raw, 472)
        kind = d.kernel.split("_")[3]
        tensor = kind == "tensor"  # the matmul2d dK/dV and dQ (backward_tensor.h)
        if tensor:
            kind = d.kernel.split("_")[4]
        hi, lo = d.constants[FC_HAS_HI], d.constants[FC_HAS_LO]
        varlen = d.constants[FC_VARLEN]
        mask_read = mask_es if d.constants[FC_MASK] else 0
        E, Ev, Hq, group = p["E"], p["Ev"], p["Hq"], p["group"]
        buffers, mma = {}, 0
        if kind in ("dkdv", "dq", "dmask"):
            de, dv = (int(x[1:]) for x in d.kernel.split("_")[-2:])
            bk, shared = bwd_tile_of(de, dv, es)
            td, tv, tk, sg = de // 8, dv // 8, bk // 8, THREADS // 32
        for L, S, count in extents:
            x = {**p, "L": L, "S": S}
            if varlen:  # each sequence's own diagonal shift
                x["shift"] = S - L if d.constants[FC_VARLEN_BR] else 0
            if kind == "delta" and L:
                rows = count * Hq * L
                _add(buffers, BUF_GRAD_OUT, rows * Ev * es)
                _add(buffers, BUF_FWD_OUT, rows * Ev * es)
                _add(buffers, BUF_FWD_LSE, rows * DELTA_LANES * 4)
                _add(buffers, BUF_GRAD_LSE, rows * 4 if d.constants[STEEL_FC_GRAD_LSE] else 0)
                _add(buffers, BUF_DELTA, written=rows * 8)
            elif tensor and kind == "dkdv":
                # Blocks of kb keys (64; 32 above head dim 128): K, V loaded once into
                # cooperative tensors; each query tile's Q and dO read by two operations each
                # (S^T and dK, dP^T and dV), its rows' statistics staged once; four
                # kb x BK x D operations a tile.
                kb = timing.attn_tensor_bwd_keys(de)
                pairs = count * Hq // group
                for key0 in range(0, S, kb):
                    vk = min(kb, S - key0)
                    _add(buffers, BUF_K, pairs * vk * E * es)
                    _add(buffers, BUF_V, pairs * vk * Ev * es)
                    _add(buffers, BUF_DK, written=pairs * vk * E * es)
                    _add(buffers, BUF_DV, written=pairs * vk * Ev * es)
                    for _, vr in _query_tiles(x, key0, TENSOR_BK, hi, lo, kb):
                        n = pairs * group
                        _add(buffers, BUF_Q, 2 * n * vr * E * es)
                        _add(buffers, BUF_GRAD_OUT, 2 * n * vr * Ev * es)
                        _add(buffers, BUF_FWD_LSE, n * vr * 4)
                        _add(buffers, BUF_DELTA, n * vr * 8)
                        _add(buffers, BUF_MASK, n * vr * vk * mask_read)
                        mma += n * 4 * kb * TENSOR_BK * de // 512
            elif tensor and kind == "dq":
                # The forward's blocks and key tiles: Q, dO and the rows' statistics once a
                # block, K read by two operations (S and dQ), V by one (dP); three a tile.
                n = count * Hq
                for _, vr, tiles in visited_tiles(x, TENSOR_BK, hi, lo, TENSOR_BQ):
                    _add(buffers, BUF_Q, n * vr * E * es)
                    _add(buffers, BUF_GRAD_OUT, n * vr * Ev * es)
                    _add(buffers, BUF_FWD_LSE, n * vr * 4)
                    _add(buffers, BUF_DELTA, n * vr * 8)
                    _add(buffers, BUF_DQ, written=n * vr * E * es)
                    for key0 in tiles:
                        vk = min(TENSOR_BK, S - key0)
                        _add(buffers, BUF_K, 2 * n * vk * E * es)
                        _add(buffers, BUF_V, n * vk * Ev * es)
                        _add(buffers, BUF_MASK, n * vr * vk * mask_read)
                        mma += n * 3 * TENSOR_BQ * TENSOR_BK * de // 512
            elif tensor and kind == "dmask":
                # The dQ kernel's blocks and key tiles, those of the threadgroup's own tile
                # (or row blocks / key tiles where the mask broadcasts): Q, dO and the rows'
                # statistics once per block that sees one of its tiles, K and V once per visited
                # tile (two operations a tile), the mask once an element; dmask written once.
                n = count * Hq
                owned = [(0, S)] if d.constants[FC_DMASK_KEYS] else [
                    (t, min(t + TENSOR_BK, S)) for t in range(0, S, TENSOR_BK)]  # fmt: skip
                for _, vr, tiles in visited_tiles(x, TENSOR_BK, hi, lo, TENSOR_BQ):
                    for lo_key, hi_key in owned:
                        mine = [t for t in tiles if lo_key <= t < hi_key]
                        if not mine:
                            continue
                        _add(buffers, BUF_Q, n * vr * E * es)
                        _add(buffers, BUF_GRAD_OUT, n * vr * Ev * es)
                        _add(buffers, BUF_FWD_LSE, n * vr * 4)
                        _add(buffers, BUF_DELTA, n * vr * 8)
                        for key0 in mine:
                            vk = min(TENSOR_BK, S - key0)
                            _add(buffers, BUF_K, n * vk * E * es)
                            _add(buffers, BUF_V, n * vk * Ev * es)
                            _add(buffers, BUF_MASK, n * vr * vk * mask_es)
                            mma += n * 2 * TENSOR_BQ * TENSOR_BK * de // 512
                rows = 1 if dm_rs == 0 else L
                keys = 1 if dm_cs == 0 else S
                _add(buffers, BUF_DMASK, written=count * Hq // dm_combos * rows * keys * mask_es)
            elif kind == "dkdv":
                pairs = count * Hq // group
                for key0 in range(0, S, 32):
                    vk = min(32, S - key0)
                    _add(buffers, BUF_K, pairs * vk * E * es)
                    _add(buffers, BUF_V, pairs * vk * Ev * es)
                    _add(buffers, BUF_DK, written=pairs * vk * E * es)
                    _add(buffers, BUF_DV, written=pairs * vk * Ev * es)
                    for _, vr in _query_tiles(x, key0, bk, hi, lo):
                        n = pairs * group
                        _add(buffers, BUF_Q, (2 if shared else 1) * n * vr * E * es)
                        _add(buffers, BUF_GRAD_OUT, n * vr * Ev * es)
                        _add(buffers, BUF_FWD_LSE, n * vr * 4)
                        _add(buffers, BUF_DELTA, n * vr * 8)
                        _add(buffers, BUF_MASK, n * vr * vk * mask_read)
                        mma += n * sg * tk * (2 * td + 2 * tv)
            elif kind == "dq":
                n = count * Hq
                for _, vr, tiles in visited_tiles(x, bk, hi, lo):
                    _add(buffers, BUF_Q, n * vr * E * es)
                    _add(buffers, BUF_GRAD_OUT, n * vr * Ev * es)
                    _add(buffers, BUF_FWD_LSE, n * vr * 4 * 4)
                    _add(buffers, BUF_DELTA, n * vr * 4 * 8)
                    _add(buffers, BUF_DQ, written=n * vr * E * es)
                    for key0 in tiles:
                        vk = min(bk, S - key0)
                        _add(buffers, BUF_K, n * vk * E * es)
                        _add(buffers, BUF_V, n * vk * Ev * es)
                        _add(buffers, BUF_MASK, n * vr * vk * mask_read)
                        mma += n * sg * tk * (2 * td + tv)
            elif kind == "dmask":
                # Each (batch entry, head) pair is summed by one threadgroup per mask element
                # tile it touches: its row blocks' Q and dO once per key-tile threadgroup, the
                # visible tiles among the threadgroup's own.
                n = count * Hq
                key_tgs = 1 if d.constants[FC_DMASK_KEYS] else -(-S // bk)
                for _, vr, tiles in visited_tiles(x, bk, hi, lo):
                    _add(buffers, BUF_Q, n * key_tgs * vr * E * es)
                    _add(buffers, BUF_GRAD_OUT, n * key_tgs * vr * Ev * es)
                    _add(buffers, BUF_FWD_LSE, n * key_tgs * vr * 4 * 4)
                    _add(buffers, BUF_DELTA, n * key_tgs * vr * 4 * 8)
                    for key0 in tiles:
                        vk = min(bk, S - key0)
                        _add(buffers, BUF_K, n * vk * E * es)
                        _add(buffers, BUF_V, n * vk * Ev * es)
                        _add(buffers, BUF_MASK, n * vr * vk * mask_es)
                        mma += n * sg * tk * (td + tv)
                rows = 1 if dm_rs == 0 else L
                keys = 1 if dm_cs == 0 else S
                elements = count * Hq // dm_combos * rows * keys
                _add(buffers, BUF_DMASK, written=elements * mask_es)
            elif kind == "dsinks":
                rows = count * L
                _add(buffers, BUF_FWD_LSE, Hq * rows * 4)
                _add(buffers, BUF_DELTA, Hq * rows * 8)  # every row has a finite lse (the sink)
        if kind == "dsinks":
            _add(buffers, BUF_SINKS, Hq * 32 * sinks_es)
            _add(buffers, BUF_DSINKS, written=Hq * sinks_es)
        if varlen and kind != "dsinks":
            launched = d.grid[0] * d.grid[1] * d.grid[2] * d.threads[0]
            _add(buffers, BUF_BWD_CU_Q, launched * 2 * 4)
            _add(buffers, BUF_BWD_CU_K, launched * 2 * 4)
        results.append((buffers, mma))
    return results


def backward_minimum(q, k, v, mask_numel, es, mask_es):
    """The least a backward can move: q, k, v, grad_out, out read once, lse read once; dq, dk,
    dv written once; the mask read once and, when its gradient is asked, written once."""
    rows = q.numel() // q.shape[-1]
    ev = v.shape[-1]
    reads = (q.numel() + k.numel() + v.numel() + 2 * rows * ev) * es + rows * 4
    return reads + (q.numel() + k.numel() + v.numel()) * es + 2 * mask_numel * mask_es


def backward_mma(plan, batch, es):
    """Predicted MMAs of each dispatch of an "sdpa_backward" plan (backward_model's count): dK/dV
    visits, per 32-key block and query head of its group, the query tiles that see the block,
    with four products a tile (S^T, dV, dP^T, dK); dQ visits the forward's key tiles with three
    (S, dP, dQ); dmask two (S, dP). The pre-pass and dsinks use none."""
    p = params(plan.dispatches[0], BUF_BWD_PARAMS)
    return [m for _, m in backward_model(plan, [(p["L"], p["S"], batch)], es)]


def visible_pairs(L, S, options):
    """(row, key) pairs the options let a row see (causal, window, alignment)."""
    shift = S - L if options.get("bottom_right") else 0
    hi = options.get("window_right", -1)
    lo = options.get("window_left", -1)
    total = 0
    for i in range(L):
        end = S - 1
        if options.get("is_causal"):
            end = min(end, i + shift)
        if hi >= 0:
            end = min(end, i + shift + hi)
        begin = max(0, i + shift - lo) if lo >= 0 else 0
        total += max(0, end - begin + 1)
    return total


def total(buffers) -> int:
    return sum(v["read"] + v["written"] for v in buffers.values())


def counted(counters) -> dict[int, dict[str, int]]:
    """The simulator's per-binding bytes of the one dispatch, without the params struct (set
    with setBytes: constant memory read from cache by every thread, not device traffic)."""
    (c,) = counters
    return {
        i: dict(v)
        for i, v in c["buffers"].items()
        if (v["read"] or v["written"]) and i != BUF_PARAMS
    }


def inputs(B, Hq, Hkv, L, S, E, Ev, mask_shape, dtype, device):
    q = torch.randn(B, Hq, L, E, dtype=dtype, device=device)
    k = torch.randn(B, Hkv, S, E, dtype=dtype, device=device)
    v = torch.randn(B, Hkv, S, Ev, dtype=dtype, device=device)
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, device=device) > 0.1
    return q, k, v, mask


def run_options(E, options):
    base = {"dropout_p": 0.0, "is_causal": False, "scale": 1 / math.sqrt(E), "softcap": 0.0,
            "window_left": -1, "window_right": -1, "bottom_right": False}  # fmt: skip
    return {**base, **options}


def counted_mma(counters) -> int:
    """The one dispatch's simdgroup MMAs plus its tensor operations' MMA-equivalents (8x8x8
    multiply-adds): a kernel has one or the other."""
    (c,) = counters
    return c["mma"] + c["tensor_multiply_adds"] // 512


def sim_column(op, tensors, opts, predicted, mma):
    """(the simulator's MB, 1 if its counters disagree with the model else 0)."""
    _, counters = sim.run_op(op, tensors, opts, counters=True, checkers=False)
    got = counted(counters)
    column = f"{total(got) / 1e6:.3f}"
    if got == predicted and counted_mma(counters) == mma:
        return column, 0
    print(f"  model {predicted} mma {mma}\n  sim   {got} mma {counted_mma(counters)}",
          file=sys.stderr)  # fmt: skip
    return column + " MISMATCH", 1


def traffic_table(dtype, sim_limit, device=None) -> int:
    es = torch.finfo(dtype).bits // 8
    run_sim = sim.available()
    failures = 0
    print(f"steel attention forward, {dtype}; traffic in MB; MMAs in thousands")
    print(
        f"{'shape':28} {'kernel':30} {'model MB':>9} {'min MB':>8} {'ratio':>6} {'sim MB':>9} "
        f"{'kMMA':>9} {'ideal':>9} {'tiles':>6} {'scratch':>7}"
    )
    for name, B, Hq, Hkv, L, S, E, Ev, options, mask_shape in SHAPES:
        q, k, v, mask = inputs(B, Hq, Hkv, L, S, E, Ev, mask_shape, dtype, "meta")
        opts = {**run_options(E, options), **(device or {})}
        p = sim.plan("sdpa", [q, k, v, mask, None], opts)
        if not p.ok:
            print(f"{name:28} refused: {p.reason}")
            continue
        predicted, mma, tiles, dense_tiles = model(p, B, es, 1, 0)
        minimum = (q.numel() + k.numel()) * es + v.numel() * es + B * Hq * L * (Ev * es + 4)
        if mask is not None:
            minimum += mask.numel()
        ideal = B * Hq * visible_pairs(L, S, options) * (E + Ev) / 512
        scratch = sum(math.prod(a.sizes) for a in p.allocations if a.name not in ("out", "lse"))
        moved = total(predicted)
        kernel = p.dispatches[0].kernel.replace("steel_attention_", "")
        sim_col = "-"
        if run_sim and B * Hq * L * S * (E + Ev) <= sim_limit:
            cq, ck, cv, cmask = inputs(B, Hq, Hkv, L, S, E, Ev, mask_shape, dtype, "cpu")
            sim_col, bad = sim_column("sdpa", [cq, ck, cv, cmask, None], opts, predicted, mma)
            failures += bad
        print(
            f"{name:28} {kernel:30} {moved / 1e6:9.3f} {minimum / 1e6:8.3f} "
            f"{moved / minimum:6.2f} {sim_col:>9} {mma / 1e3:9.1f} {ideal / 1e3:9.1f} "
            f"{tiles / dense_tiles:6.2f} {scratch:7d}"
        )
    if failures:
        print(f"{failures} shape(s) where the model and the simulator disagree")
    return failures


def cu_seqlens(lengths, device="cpu"):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def varlen_inputs(lq, lk, Hq, Hkv, E, dtype, device):
    q = torch.randn(sum(lq), Hq, E, dtype=dtype, device=device)
    k = torch.randn(sum(lk), Hkv, E, dtype=dtype, device=device)
    v = torch.randn(sum(lk), Hkv, E, dtype=dtype, device=device)
    return [q, k, v, cu_seqlens(lq), cu_seqlens(lk), None]


def varlen_table(dtype, sim_limit, device=None) -> int:
    """The packed batch's traffic (model == simulator) against the sum of its sequences'
    minimums, and the dense plan of the batch padded to (max_seqlen_q, max_seqlen_k)."""
    es = torch.finfo(dtype).bits // 8
    run_sim = sim.available()
    failures = 0
    print(f"\nsteel varlen attention forward (one dispatch per packed batch), {dtype}; MB")
    print(f"{'batch':34} {'model MB':>9} {'min MB':>8} {'ratio':>6} {'sim MB':>9} "
          f"{'padded MB':>9} {'kMMA':>9} {'ideal':>9} {'tiles':>6}")  # fmt: skip
    for name, lq, lk, Hq, Hkv, E, options in VARLEN_SHAPES:
        opts = {**run_options(E, options), "max_seqlen_q": max(lq), "max_seqlen_k": max(lk),
                **(device or {})}  # fmt: skip
        tensors = varlen_inputs(lq, lk, Hq, Hkv, E, dtype, "meta")
        p = sim.plan("sdpa_varlen", tensors, opts)
        if not p.ok:
            print(f"{name:34} refused: {p.reason}")
            continue
        predicted, mma, tiles, dense_tiles = varlen_model(p, lq, lk, es, 0)
        moved = total(predicted)
        # Each sequence moved once: its q, k, v rows, its out rows and lse entries.
        minimum = sum(Hq * L * E * es * 2 + Hq * L * 4 + 2 * Hkv * S * E * es
                      for L, S in zip(lq, lk, strict=True))  # fmt: skip
        ideal = sum(Hq * visible_pairs(L, S, options) * 2 * E / 512
                    for L, S in zip(lq, lk, strict=True))  # fmt: skip
        B = len(lq)
        pq, pk, pv, _ = inputs(B, Hq, Hkv, max(lq), max(lk), E, E, None, dtype, "meta")
        dense = sim.plan("sdpa", [pq, pk, pv, None, None], {**run_options(E, options),
                                                             **(device or {})})  # fmt: skip
        padded = total(model(dense, B, es, 1, 0)[0])
        sim_col = "-"
        work = sum(Hq * L * S * 2 * E for L, S in zip(lq, lk, strict=True))
        if run_sim and work <= sim_limit:
            cpu = varlen_inputs(lq, lk, Hq, Hkv, E, dtype, "cpu")
            sim_col, bad = sim_column("sdpa_varlen", cpu, opts, predicted, mma)
            failures += bad
        print(f"{name:34} {moved / 1e6:9.3f} {minimum / 1e6:8.3f} {moved / minimum:6.2f} "
              f"{sim_col:>9} {padded / 1e6:9.3f} {mma / 1e3:9.1f} {ideal / 1e3:9.1f} "
              f"{tiles / dense_tiles:6.2f}")  # fmt: skip
    if failures:
        print(f"{failures} varlen batch(es) where the model and the simulator disagree")
    return failures


# (name, B, Hq, Hkv, L, S, E, options, page size or None) of one decode call
DECODE_SHAPES = [
    ("1 token, KV 4k, GQA 32/8 d128", 1, 32, 8, 1, 4096, 128, {}, None),
    ("1 token, KV 32k, GQA 32/8 d128", 1, 32, 8, 1, 32768, 128, {}, None),
    ("B 8, KV 4k, MHA 8 d64", 8, 8, 8, 1, 4096, 64, {}, None),
    ("4 tokens, KV 2k, GQA 16/4 causal", 2, 16, 4, 4, 2048, 128,
     {"is_causal": True, "bottom_right": True}, None),
    ("paged 16, KV 1k..8k, GQA 32/8", 4, 32, 8, 1, 8192, 128, {}, 16),
    ("sim: 1 token, KV 1000, GQA 8/2 d64", 1, 8, 2, 1, 1000, 64, {}, None),
    ("sim: 3 tokens, KV 700, GQA 4/1 mask", 2, 4, 1, 3, 700, 64, {"mask": True, "sinks": True},
     None),
    ("sim: paged 64, KV 1..900, GQA 8/2", 3, 8, 2, 2, 900, 64, {"sinks": True}, 64),
    # Absorbed MLA (DeepSeek-V3: 128 heads on the one latent head; its scale is the model's),
    # V the latent's first 512 columns (the alias), and a copy of them (the general path).
    ("MLA 1 token, latent 4k, 128 heads", 1, 128, 1, 1, 4096, MLA_E, {"mla": "alias"}, None),
    ("same, V a copy", 1, 128, 1, 1, 4096, MLA_E, {"mla": "copy"}, None),
    ("MLA paged 64, latent 1k..8k, H16", 4, 16, 1, 2, 8192, MLA_E, {"mla": "alias"}, 64),
    ("sim: MLA 2 tokens, latent 600, H16", 1, 16, 1, 2, 600, MLA_E,
     {"mla": "alias", "scale": 0.1}, None),
    ("sim: same, V a copy", 1, 16, 1, 2, 600, MLA_E, {"mla": "copy", "scale": 0.1}, None),
    ("sim: MLA paged 16, 1..300, H16", 2, 16, 1, 1, 300, MLA_E, {"mla": "alias"}, 16),
]  # fmt: skip


def decode_params(dispatch):
    """AttnDecodeParams (params.h): the forward's fields, then the split and the cache."""
    out = params(dispatch)
    raw = next(b.bytes for b in dispatch.bindings if b.index == BUF_PARAMS)
    out.update(timing.decode_params_fields(raw))
    return out


def decode_block(d, p, add, i0, last, S, shift, bk, es, mask_es, sinks_es):
    """One block of query rows i0..last of a sequence of S keys, for every partition and KV head
    (chunk) of the grid: adds its traffic with `add`, returns the key tiles it visits."""
    paged, split = d.constants[FC_PAGED], d.constants[FC_SPLIT]
    alias = d.constants.get(FC_KV_ALIAS, False)
    begin, end = 0, S
    if d.constants[FC_HAS_HI]:
        end = min(end, last + shift + p["hi_off"] + 1)
    if d.constants[FC_HAS_LO]:
        begin = max(0, i0 + shift - p["lo_off"])
    t0, t1 = begin // bk, (-(-end // bk) if end > begin else begin // bk)
    per = p["split_keys"] // bk
    rows = p["heads_per_tg"] * (last - i0 + 1)
    chunks = p["group"] // p["heads_per_tg"]
    tiles = 0
    for s in range(p["splits"]):
        ts = range(max(t0, s * per), max(max(t0, s * per), min(t1, (s + 1) * per)))
        keys = sum(min(bk, S - t * bk) for t in ts)
        for _ in range(p["Hq"] // p["group"] * chunks):
            tiles += len(ts)
            add(BUF_Q, "read", rows * p["E"] * es)
            add(BUF_K, "read", keys * p["E"] * es)
            if not alias:
                add(BUF_V, "read", keys * p["Ev"] * es)
            if paged:  # each loading simdgroup's lanes read the K tile's rows' entries once
                add(BUF_TABLE, "read", THREADS // 32 * keys * 4)  # (decode.h load_k; V shares)
            if d.constants[FC_MASK]:
                add(BUF_MASK, "read", rows * keys * mask_es)
            if split:
                add(BUF_PART_O, "written", rows * p["Ev"] * 4)
                add(BUF_PART_ML, "written", rows * 2 * 4)
            else:
                if d.constants[FC_SINKS]:
                    # decode.h: every lane of the block; decode_vector.h: each lane of key set
                    # 0 (its row sets' simdgroups), once for each of its live row slots
                    # (ceil(packed rows / row sets)), whatever the block's width
                    reads = THREADS
                    if d.kernel.startswith("steel_attention_decode_vector_"):
                        de, dv = (int(x[1:]) for x in d.kernel.split("_")[-2:])
                        packed = d.constants[timing._FC_DECODE_ROWS]
                        sets = timing._decode_vector_row_sets(de, dv, es, packed)
                        reads = 32 * sets * -(-packed // sets)
                    add(BUF_SINKS, "read", reads * sinks_es)
                add(BUF_OUT, "written", rows * p["Ev"] * es)
                add(BUF_LSE, "written", rows * 4)
    return tiles


def decode_model(plan, seqs, es, mask_es, sinks_es):
    """Per dispatch of a decode plan, ({binding: {"read", "written"}}, MMAs), from decode.h's loops
    (decode_vector.h's move the same bytes but q and run no MMA; decode.h's simdgroups whose 8
    rows are all empty run none either). `seqs` lists (L, S) per batch
    entry or sequence. Every threadgroup of the partial kernel reads its rows' q (each split again,
    and in the vector kernel each key set again: q is small), the K and V rows of the key tiles
    of its partition that some row may see (bounded at S and the head dims), the mask of its
    rows there, one block-table entry per key tile row and loading simdgroup (paged), and writes
    out and lse (one pass) or the fp32 partials; the merge reads each row's partials once. Every
    lane reads the cu_seqlens / seqused_k entries and the sink it needs."""
    d = plan.dispatches[0]
    p = decode_params(d)
    de, dv = (int(x[1:]) for x in d.kernel.split("_")[-2:])
    bk = bk_of(de, dv, es)
    varlen, paged, split = d.constants[FC_VARLEN], d.constants[FC_PAGED], d.constants[FC_SPLIT]
    buffers: dict[int, dict[str, int]] = {}

    def add(index, kind, n):
        entry = buffers.setdefault(index, {"read": 0, "written": 0})
        entry[kind] += n

    threads = d.threads[0]  # the vector kernel's 4, 8 or 16 simdgroups (decode_simdgroups)
    tiles = mma = 0
    for L, S in seqs:
        if varlen:
            add(BUF_CU_Q, "read", d.grid[0] * d.grid[1] * threads * 2 * 4)
            add(BUF_SEQUSED if paged else BUF_CU_K, "read",
                d.grid[0] * d.grid[1] * threads * (1 if paged else 2) * 4)  # fmt: skip
        if L == 0:
            continue
        shift = (S - L if d.constants[FC_VARLEN_BR] else 0) if varlen else p["shift"]
        for i0 in range(0, L, p["row_block"]):
            last = min(i0 + p["row_block"], L) - 1
            t = decode_block(d, p, add, i0, last, S, shift, bk, es, mask_es, sinks_es)
            tiles += t
            # the MMA kernel's simdgroups (8 rows each) that hold a real row of the block
            real = (p["heads_per_tg"] - 1) * p["row_block"] + last - i0 + 1
            mma += t * min(THREADS // 32, -(-real // 8)) * (bk // 8) * (de // 8 + dv // 8)
    if d.kernel.startswith("steel_attention_decode_vector_"):
        mma = 0
        # Its simdgroups are row sets x key sets (params.h steel_attn_decode_vector_row_sets):
        # each key set loads its rows' q into registers, so q is read once per key set.
        packed = d.constants[timing._FC_DECODE_ROWS]
        key_sets = threads // 32 // timing._decode_vector_row_sets(de, dv, es, packed)
        buffers[BUF_Q]["read"] *= key_sets
    models = [(buffers, mma)]
    if split:
        merge: dict[int, dict[str, int]] = {}
        heads = p["Hq"]
        for L, _ in seqs:
            if varlen:
                entry = merge.setdefault(BUF_CU_Q, {"read": 0, "written": 0})
                entry["read"] += p["rows"] * heads * 32 * 2 * 4
            for index, kind, n in [
                (BUF_PART_ML, "read", p["splits"] * 2 * 4),
                (BUF_PART_O, "read", p["splits"] * p["Ev"] * 4),
                (BUF_SINKS, "read", 32 * sinks_es if d.constants[FC_SINKS] else 0),
                (BUF_OUT, "written", p["Ev"] * es),
                (BUF_LSE, "written", 4),
            ]:
                if n:
                    entry = merge.setdefault(index, {"read": 0, "written": 0})
                    entry[kind] += n * heads * L
        models.append((merge, 0))
    return models


def counted_all(counters) -> list[dict[int, dict[str, int]]]:
    """counted() for every dispatch of a plan."""
    return [counted([c]) for c in counters]


def decode_inputs(B, Hq, Hkv, L, S, E, options, page, dtype, device):
    """[q, k, v, mask, sinks] for "sdpa", or the paged "sdpa_varlen" tensors (ragged lengths up
    to S over shuffled pages), with the run options and the (L, S) of each sequence."""
    options = dict(options)
    mla = options.pop("mla", None)  # "alias": v = k[..., :512] of a 576-column latent; "copy"
    opts = run_options(E, {k: v for k, v in options.items() if k not in ("mask", "sinks")})
    sinks = torch.randn(Hq, dtype=torch.float32, device=device) if options.get("sinks") else None

    def value(k, v):
        if mla is None:
            return v
        return k[..., :MLA_EV] if mla == "alias" else k[..., :MLA_EV].clone()

    if page is None:
        q, k, v, _ = inputs(B, Hq, Hkv, L, S, E, E, None, dtype, device)
        mask = torch.rand(B, 1, L, S, device=device) > 0.2 if options.get("mask") else None
        return [q, k, value(k, v), mask, sinks], opts, [(L, S)] * B
    used = [max(1, S * (b + 1) // B) for b in range(B)]
    need = [-(-n // page) for n in used]
    pool = sum(need)
    k = torch.randn(pool, page, Hkv, E, dtype=dtype, device=device)
    v = value(k, torch.randn(pool, page, Hkv, E, dtype=dtype, device=device))
    order = torch.randperm(pool, generator=torch.Generator().manual_seed(0))
    table = torch.zeros(B, max(need), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = order[at : at + n].to(torch.int32)
        at += n
    q = torch.randn(B * L, Hq, E, dtype=dtype, device=device)
    cu_q = cu_seqlens([L] * B, device)
    seq = torch.tensor(used, dtype=torch.int32, device=device)
    tensors = [q, k, v, cu_q, None, sinks, table.to(device), seq]
    opts = {**opts, "max_seqlen_q": L, "max_seqlen_k": max(used), "bottom_right": True}
    return tensors, opts, [(L, n) for n in used]


def decode_table(dtype, sim_limit) -> int:
    """Decode plans: partitions, K + V read against the cache (once under GQA packing), the
    scratch, and the model against the simulator's counters per dispatch."""
    es = torch.finfo(dtype).bits // 8
    run_sim = sim.available()
    failures = 0
    print(f"\nsteel attention decode, {dtype}; traffic in MB")
    print(f"{'shape':36} {'splits':>6} {'heads/tg':>8} {'cache MB':>9} {'K+V MB':>9} "
          f"{'ratio':>6} {'total MB':>9} {'scratch MB':>10} {'sim MB':>16}")  # fmt: skip
    for name, B, Hq, Hkv, L, S, E, options, page in DECODE_SHAPES:
        tensors, opts, seqs = decode_inputs(B, Hq, Hkv, L, S, E, options, page, dtype, "meta")
        op = "sdpa" if page is None else "sdpa_varlen"
        p = sim.plan(op, tensors, opts)
        if not p.ok:
            print(f"{name:36} refused: {p.reason}")
            continue
        mask_es = 1
        sinks_es = 4
        models = decode_model(p, seqs, es, mask_es, sinks_es)
        # The cache: K and V rows, or (MLA) the latent rows alone, whose prefix is V.
        cache = sum((1 if "mla" in options else 2) * Hkv * n * E * es for _, n in seqs)
        kv = sum(models[0][0].get(i, {"read": 0})["read"] for i in (BUF_K, BUF_V))
        moved = sum(total(b) for b, _ in models)
        scratch = sum(math.prod(a.sizes) * 4 for a in p.allocations if not a.is_output)
        dp = decode_params(p.dispatches[0])
        sim_col = "-"
        if run_sim and sum(Hq * L * n * 2 * E for _, n in seqs) <= sim_limit:
            cpu, _, _ = decode_inputs(B, Hq, Hkv, L, S, E, options, page, dtype, "cpu")
            _, counters = sim.run_op(op, cpu, opts, counters=True, checkers=False)
            got = counted_all(counters)
            sim_col = f"{sum(total(g) for g in got) / 1e6:.3f}"
            if got != [b for b, _ in models] or [c["mma"] for c in counters] != [
                m for _, m in models
            ]:
                print(f"  model {models}\n  sim   {got}", file=sys.stderr)
                sim_col += " MISMATCH"
                failures += 1
        print(f"{name:36} {dp['splits']:6} {dp['heads_per_tg']:8} {cache / 1e6:9.3f} "
              f"{kv / 1e6:9.3f} {kv / cache:6.3f} {moved / 1e6:9.3f} {scratch / 1e6:10.3f} "
              f"{sim_col:>16}")  # fmt: skip
    if failures:
        print(f"{failures} decode shape(s) where the model and the simulator disagree")
    return failures


# (name, B, Hq, L, latent rows) of an absorbed-MLA decode call the timing model predicts
MLA_PREDICT_SHAPES = [("MLA 2 tokens, latent 4k, 16 heads", 1, 16, 2, 4096)]


def mla_predict_table(chips, dtype) -> None:
    """The timing model (sim.predict) on absorbed-MLA decode with V the latent's prefix (the
    alias) and with V a copy (the general path): DRAM bytes and predicted time per chip."""
    print(f"\nabsorbed MLA decode, {dtype}: the timing model, V aliased vs copied")
    print(f"{'shape':36} {'chip':10} {'V':6} {'device MB':>9} {'time us':>9} {'bound':>8}")
    for name, B, Hq, L, S in MLA_PREDICT_SHAPES:
        for mla in ("alias", "copy"):
            tensors, opts, _ = decode_inputs(B, Hq, 1, L, S, MLA_E, {"mla": mla}, None, dtype,
                                             "cpu")  # fmt: skip
            _, counters = sim.run_op("sdpa", tensors, opts, counters=True, checkers=False)
            moved = sum(total(g) for g in counted_all(counters))
            for chip in chips:
                r = sim.predict("sdpa", tensors, opts, chip=chip)
                print(f"{name:36} {chip:10} {mla:6} {moved / 1e6:9.3f} "
                      f"{r['time_s'] * 1e6:9.1f} {r['bound']:>8}")  # fmt: skip


def decode_mps_table(dtype, iters) -> None:
    """Decode on MPS: one new token per sequence against KV 1k..32k, steel against F.sdpa
    (enable_gqa for GQA 4), time per call and tokens per second, as a table and a plot."""
    import torch.nn.functional as F

    import torch_steel

    rows = []
    print(f"\nMPS decode: steel.sdpa against F.sdpa, {dtype}, median of {iters} runs, 1 token")
    print(f"{'B':>2} {'H':>3} {'GQA':>3} {'KV':>6} {'D':>4} {'steel ms':>9} {'F.sdpa ms':>9} "
          f"{'steel tok/s':>11} {'F.sdpa tok/s':>12} {'speedup':>7}")  # fmt: skip
    for B in (1, 4, 8):
        for H in (8, 32):
            for gqa in (1, 4):
                for S in (1024, 4096, 16384, 32768):
                    for D in (64, 128):
                        q, k, v, _ = inputs(B, H, H // gqa, 1, S, D, D, None, dtype, "mps")

                        def ours(q=q, k=k, v=v, g=gqa > 1):
                            return torch_steel.sdpa(q, k, v, enable_gqa=g)

                        def theirs(q=q, k=k, v=v, g=gqa > 1):
                            return F.scaled_dot_product_attention(q, k, v, enable_gqa=g)

                        shape = f"{B:2} {H:3} {gqa:3} {S:6} {D:4}"
                        try:
                            t_ours, t_theirs = time_ms(ours, iters), time_ms(theirs, iters)
                        except RuntimeError as error:
                            print(f"{shape} failed: {error}")
                            continue
                        rows.append((B, H, gqa, S, D, t_ours, t_theirs))
                        print(f"{shape} {t_ours:9.3f} {t_theirs:9.3f} {B * 1e3 / t_ours:11.0f} "
                              f"{B * 1e3 / t_theirs:12.0f} {t_theirs / t_ours:7.2f}")  # fmt: skip
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots()
    for gqa in (1, 4):
        for D in (64, 128):
            pts = [(r[3], r[0] * 1e3 / r[5]) for r in rows
                   if r[0] == 1 and r[1] == 32 and r[2] == gqa and r[4] == D]  # fmt: skip
            ref = [(r[3], r[0] * 1e3 / r[6]) for r in rows
                   if r[0] == 1 and r[1] == 32 and r[2] == gqa and r[4] == D]  # fmt: skip
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"steel GQA {gqa} D {D}")
                ax.plot(*zip(*ref, strict=True), linestyle="--", label=f"F.sdpa GQA {gqa} D {D}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV length (B 1, H 32, 1 query token)")
    ax.set_ylabel("tokens per second")
    ax.legend()
    fig.savefig(Path(__file__).with_name("decode_mps.png"), dpi=120)


def backward_table(dtype, sim_limit) -> int:
    """The backward's traffic per plan (model == simulator where it runs) against the minimum;
    its only scratch is delta, two floats per query row: O(L) memory, no L x S buffer."""
    es = torch.finfo(dtype).bits // 8
    run_sim = sim.available()
    failures = 0
    print(f"\nsteel attention backward, {dtype}; traffic in MB (all dispatches); MMAs in thousands")
    print(f"{'shape':28} {'model MB':>9} {'min MB':>8} {'ratio':>6} {'sim MB':>9} {'kMMA':>9} "
          f"{'ideal':>9} {'scratch B':>10}")  # fmt: skip
    for name, B, Hq, Hkv, L, S, E, Ev, options, _ in SHAPES:
        opts = run_options(E, options)
        tensors = backward_inputs(B, Hq, Hkv, L, S, E, Ev, dtype, "meta")
        p = sim.plan("sdpa_backward", tensors, opts)
        if not p.ok:
            print(f"{name:28} refused: {p.reason}")
            continue
        predicted = backward_model(p, [(L, S, B)], es)
        moved = sum(total(b) for b, _ in predicted)
        mma = sum(m for _, m in predicted)
        minimum = backward_minimum(*tensors[1:4], 0, es, 0)
        # S, dP, dV, dK, dQ over the visible pairs: 2 E + 3 Ev (in 8x8x8 products) a pair.
        ideal = B * Hq * visible_pairs(L, S, options) * (3 * E + 2 * Ev) / 512
        scratch = sum(math.prod(a.sizes) * 4 for a in p.allocations if not a.is_output)
        sim_col = "-"
        if run_sim and B * Hq * L * S * (E + Ev) <= sim_limit:
            cpu = backward_inputs(B, Hq, Hkv, L, S, E, Ev, dtype, "cpu")
            _, counters = sim.run_op("sdpa_backward", cpu, opts, counters=True, checkers=False)
            got = counted_backward(counters)
            sim_col = f"{sum(total(b) for b in got) / 1e6:.3f}"
            if got != [b for b, _ in predicted] or [c["mma"] for c in counters] != [
                m for _, m in predicted
            ]:
                sim_col += " MISMATCH"
                failures += 1
        print(f"{name:28} {moved / 1e6:9.3f} {minimum / 1e6:8.3f} {moved / minimum:6.2f} "
              f"{sim_col:>9} {mma / 1e3:9.1f} {ideal / 1e3:9.1f} {scratch:10d}")  # fmt: skip
    if failures:
        print(f"{failures} shape(s) where the backward model and the simulator disagree")
    return failures


def counted_backward(counters):
    """The simulator's per-binding bytes of each backward dispatch, without the params."""
    return [
        {i: dict(v) for i, v in c["buffers"].items()
         if (v["read"] or v["written"]) and i != BUF_BWD_PARAMS}
        for c in counters
    ]  # fmt: skip


def backward_inputs(B, Hq, Hkv, L, S, E, Ev, dtype, device):
    """The "sdpa_backward" tensors [grad_out, q, k, v, out, lse, mask, sinks, grad_lse]."""
    q, k, v, _ = inputs(B, Hq, Hkv, L, S, E, Ev, None, dtype, device)
    out = torch.randn(B, Hq, L, Ev, dtype=dtype, device=device)
    lse = torch.randn(B, Hq, L, dtype=torch.float32, device=device)
    return [torch.randn_like(out), q, k, v, out, lse, None, None, None]


def peak_mb(fn):
    torch.mps.synchronize()
    torch.mps.empty_cache()
    base = torch.mps.driver_allocated_memory()
    fn()
    torch.mps.synchronize()
    return (torch.mps.driver_allocated_memory() - base) / 1e6


def time_mps(B, H, L, D, causal, dtype, iters):
    """(steel ms, F.sdpa ms, steel MB, F.sdpa MB) for one shape on MPS."""
    import torch.nn.functional as F

    import torch_steel

    q, k, v, _ = inputs(B, H, H, L, L, D, D, None, dtype, "mps")

    def ours():
        return torch_steel.sdpa(q, k, v, is_causal=causal)

    def theirs():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return time_ms(ours, iters), time_ms(theirs, iters), peak_mb(ours), peak_mb(theirs)


def mps_table(dtype, iters) -> None:
    rows = []
    print(f"\nMPS: steel.sdpa against F.sdpa, {dtype}, median of {iters} runs")
    print(f"{'B':>2} {'H':>3} {'L':>6} {'D':>4} {'causal':>6} {'steel ms':>9} {'F.sdpa ms':>9} "
          f"{'speedup':>7} {'steel MB':>9} {'F.sdpa MB':>9}")  # fmt: skip
    for B in (1, 4, 8):
        for H in (8, 32):
            for L in (128, 1024, 4096, 16384):
                for D in (64, 128):
                    for causal in (False, True):
                        shape = f"{B:2} {H:3} {L:6} {D:4} {causal!s:>6}"
                        try:
                            t_ours, t_theirs, m_ours, m_theirs = time_mps(
                                B, H, L, D, causal, dtype, iters
                            )
                        except RuntimeError as error:  # out of memory on the larger shapes
                            print(f"{shape} failed: {error}")
                            continue
                        rows.append((B, H, L, D, causal, t_ours, t_theirs))
                        print(f"{shape} {t_ours:9.3f} {t_theirs:9.3f} {t_theirs / t_ours:7.2f} "
                              f"{m_ours:9.1f} {m_theirs:9.1f}")  # fmt: skip
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots()
    for D in (64, 128):
        for causal in (False, True):
            pts = [(r[2], r[6] / r[5]) for r in rows if r[0] == 1 and r[1] == 8 and r[3] == D
                   and r[4] == causal]  # fmt: skip
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"D {D} causal {causal}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (B 1, H 8)")
    ax.set_ylabel("speedup over F.sdpa (MPS)")
    ax.axhline(1.2, linestyle="--", color="gray")
    ax.legend()
    fig.savefig(Path(__file__).with_name("attention_mps.png"), dpi=120)


def time_mps_training(B, H, L, D, causal, dtype, iters):
    """(steel ms, F.sdpa ms, steel MB, F.sdpa MB) of forward + backward on MPS, with autograd
    through each (steel: the backward kernels; F.sdpa: PyTorch's MPS backward, which holds the
    L x S probabilities)."""
    import torch.nn.functional as F

    import torch_steel

    q, k, v, _ = inputs(B, H, H, L, L, D, D, None, dtype, "mps")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    grad = torch.randn_like(q)

    def ours():
        torch.autograd.grad(torch_steel.sdpa(q, k, v, is_causal=causal), (q, k, v), grad)

    def theirs():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(out, (q, k, v), grad)

    return time_ms(ours, iters), time_ms(theirs, iters), peak_mb(ours), peak_mb(theirs)


def mps_training_table(dtype, iters) -> None:
    """Forward + backward against F.sdpa with autograd, the forward table's shapes."""
    print(f"\nMPS: steel.sdpa forward+backward against F.sdpa's autograd, {dtype}, median of "
          f"{iters} runs")  # fmt: skip
    print(f"{'B':>2} {'H':>3} {'L':>6} {'D':>4} {'causal':>6} {'steel ms':>9} {'F.sdpa ms':>9} "
          f"{'speedup':>7} {'steel MB':>9} {'F.sdpa MB':>9}")  # fmt: skip
    for B, H, L, D, causal in itertools.product((1, 4, 8), (8, 32), (128, 1024, 4096, 16384),
                                                (64, 128), (False, True)):  # fmt: skip
        shape = f"{B:2} {H:3} {L:6} {D:4} {causal!s:>6}"
        try:
            t_ours, t_theirs, m_ours, m_theirs = time_mps_training(B, H, L, D, causal, dtype,
                                                                   iters)  # fmt: skip
        except RuntimeError as error:  # out of memory: PyTorch's L x S backward first
            print(f"{shape} failed: {str(error).splitlines()[0]}")
            continue
        print(f"{shape} {t_ours:9.3f} {t_theirs:9.3f} {t_theirs / t_ours:7.2f} {m_ours:9.1f} "
              f"{m_theirs:9.1f}")  # fmt: skip


class TinyGPT(torch.nn.Module):
    """A small GPT (pre-norm blocks, causal F.sdpa attention, GELU MLP, tied embedding)."""

    def __init__(self, layers=6, d_model=512, heads=8, vocab=8192):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({
                "ln1": torch.nn.LayerNorm(d_model), "qkv": torch.nn.Linear(d_model, 3 * d_model),
                "proj": torch.nn.Linear(d_model, d_model), "ln2": torch.nn.LayerNorm(d_model),
                "up": torch.nn.Linear(d_model, 4 * d_model),
                "down": torch.nn.Linear(4 * d_model, d_model),
            })
            for _ in range(layers)
        )  # fmt: skip
        self.ln = torch.nn.LayerNorm(d_model)

    def forward(self, tokens):
        import torch.nn.functional as F

        x = self.embed(tokens)
        B, L, C = x.shape
        for b in self.blocks:
            q, k, v = b["qkv"](b["ln1"](x)).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + b["proj"](att.transpose(1, 2).reshape(B, L, C))
            x = x + b["down"](F.gelu(b["up"](b["ln2"](x))))
        return self.ln(x) @ self.embed.weight.T


def time_gpt_step(L, dtype, iters, patched):
    """(ms, peak MB) of one training step (forward, loss, backward, AdamW) of TinyGPT at
    sequence length L, batch 1, with F.sdpa served by steel (patched) or by PyTorch."""
    import contextlib

    import torch_steel

    model = TinyGPT().to("mps", dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 8192, (1, L + 1), device="mps")

    def step():
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[0, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    with torch_steel.patch() if patched else contextlib.nullcontext():
        return time_ms(step, iters), peak_mb(step)


def mps_gpt_table(dtype, iters) -> None:
    print(f"\nMPS: TinyGPT training step (6 layers, d_model 512, 8 heads, batch 1), {dtype}")
    print(
        f"{'L':>6} {'steel ms':>9} {'torch ms':>9} {'speedup':>7} {'steel MB':>9} {'torch MB':>9}"
    )
    for L in (1024, 2048, 4096, 8192, 16384, 32768):
        cols = []
        for patched in (True, False):
            try:
                cols.append(time_gpt_step(L, dtype, iters, patched))
            except RuntimeError as error:  # PyTorch's backward runs out of memory first
                cols.append(None)
                print(f"{L:6} {'steel' if patched else 'torch'} failed: "
                      f"{str(error).splitlines()[0]}")  # fmt: skip
        (ours, theirs) = cols
        fmt = lambda c, i: f"{c[i]:9.1f}" if c else f"{'OOM':>9}"  # noqa: E731
        speedup = f"{theirs[0] / ours[0]:7.2f}" if ours and theirs else f"{'-':>7}"
        print(f"{L:6} {fmt(ours, 0)} {fmt(theirs, 0)} {speedup} {fmt(ours, 1)} {fmt(theirs, 1)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--sim-limit", type=float, default=3e8,
                        help="run the simulator where B*H*L*S*(E+Ev) is at most this")  # fmt: skip
    parser.add_argument("--mps", action="store_true", help="time against F.sdpa on MPS")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="default", choices=sorted(DEVICES),
                        help="the device the forward and varlen tables plan for")  # fmt: skip
    parser.add_argument("--predict", metavar="CHIP",
                        help="predicted times of steel and PyTorch on CHIP of the timing model's "
                        "table (or 'all'), from simulator counters")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="--predict on a few tiny shapes")
    parser.add_argument("--modest", action="store_true", help="--predict on the docs' shapes")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out",
                        help="where --predict saves its plots")  # fmt: skip
    # 1e9 (bench_gemm.py's): the packed varlen batch (7.2e8 multiply-adds, no fit: its
    # sequences are of several lengths) runs whole in about 20 s on this machine
    parser.add_argument("--sim-budget", type=float, default=1e9,
                        help="--predict: simulate whole a shape whose reduced run has at most "
                        "this many multiply-adds; sample, fit or skip the others")  # fmt: skip
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.predict:
        import attention_predict  # noqa: PLC0415
        import side_by_side  # noqa: PLC0415

        chips = side_by_side.chip_names(args.predict)
        attention_predict.run(chips, dtype, args.quick, args.out, args.sim_budget, args.modest)
        mla_predict_table(chips, dtype)
        return 0
    device = DEVICES[args.device]
    failures = traffic_table(dtype, args.sim_limit, device)
    failures += varlen_table(dtype, args.sim_limit, device)
    failures += decode_table(dtype, args.sim_limit) + backward_table(dtype, args.sim_limit)
    if args.mps and torch.backends.mps.is_available():
        mps_table(dtype, args.iters)
        decode_mps_table(dtype, args.iters)
        mps_training_table(dtype, args.iters)
        mps_gpt_table(dtype, args.iters)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
