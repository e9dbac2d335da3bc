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
  - varlen (issue 10, item 5): packed batches of ragged sequences as one sdpa_varlen dispatch,
    modelled per sequence (each threadgroup reads its two cu_seqlens entries; blocks past its
    sequence's end read nothing else), against the sum of the sequences' minimums and against
    the dense plan of the same batch padded to the longest sequences;
  - decode (issue 9, item 7): few query rows against a KV cache, dense or paged, through the
    decode kernels: the partitions the plan chose, K and V bytes read against the cache's size
    (GQA packing reads them once per KV head: the ratio is ~1), the partials' scratch, and the
    model of every dispatch (partial kernel and merge) against the simulator's counters;
  - on a Mac with MPS (--mps): steel.sdpa against F.sdpa, median of --iters runs, and peak
    memory, for B 1..8, H 8..32, L 128..16384, D 64 and 128, causal and not, as a table and
    (with matplotlib) a plot bench/attention_mps.png; and decode: tokens per second and time
    per call for KV 1k..32k, B 1..8, H 8..32, D 64/128, GQA 1 and 4 (bench/decode_mps.png).

    python bench/bench_attention.py [--dtype float16] [--sim-limit 3e8] [--mps] [--iters 20]
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

from bench_gemm import time_ms  # noqa: E402

from torch_steel import sim  # noqa: E402

BUF_Q, BUF_K, BUF_V, BUF_MASK, BUF_SINKS, BUF_OUT, BUF_LSE, BUF_PARAMS, BUF_CU_Q, BUF_CU_K = range(
    10
)
BUF_BWD_PARAMS = 17
BUF_TABLE, BUF_SEQUSED, BUF_PART_O, BUF_PART_ML = 10, 11, 12, 13
FC_ALIGN_E, FC_ALIGN_EV, FC_VARLEN, FC_SPLIT, FC_PAGED = 302, 303, 316, 322, 323
FC_ALIGN_S, FC_MASK, FC_HAS_HI, FC_HAS_LO, FC_SINKS, FC_VARLEN_BR = 301, 310, 311, 312, 313, 317
BQ = 32
THREADS = 128
BUDGET = 20480  # STEEL_ATTN_TG_BUDGET (shaders/steel/params.h)

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
    """steel_attn_bk (params.h): the key tile of the kernel for head dims (de, dv)."""

    def ld(d):
        return d + 16 // es

    def separate(bk):
        return bk * (ld(de) + ld(dv)) * es

    def shared(bk):
        return bk * max(ld(de), ld(dv)) * es

    if separate(16) <= BUDGET:
        return 32 if separate(32) <= BUDGET else 16
    return next(bk for bk in (32, 16, 8) if shared(bk) <= BUDGET or bk == 8)


def params(dispatch, index=BUF_PARAMS):
    """The AttnParams fields the models use (the backward's params start with them, at 17)."""
    raw = next(b.bytes for b in dispatch.bindings if b.index == index)
    L, S, E, Ev, Hq, group, shift, hi_off, lo_off = struct.unpack_from("9i", raw, 0)
    return {"L": L, "S": S, "E": E, "Ev": Ev, "Hq": Hq, "group": group, "shift": shift,
            "hi_off": hi_off, "lo_off": lo_off}  # fmt: skip


def visited_tiles(p, bk, has_hi, has_lo):
    """[(first row, valid rows, [key tile starts])] per query block, as forward.h bounds them."""
    blocks = []
    for row0 in range(0, p["L"], BQ):
        last = min(row0 + BQ, p["L"]) - 1
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
    bk = bk_of(de, dv, es)
    blocks = visited_tiles(p, bk, d.constants[FC_HAS_HI], d.constants[FC_HAS_LO])
    keys = sum(min(bk, p["S"] - k0) for _, _, tiles in blocks for k0 in tiles)
    tiles = sum(len(t) for _, _, t in blocks)
    buffers = {
        BUF_Q: {"read": heads * p["L"] * p["E"] * es, "written": 0},
        BUF_K: {"read": heads * keys * p["E"] * es, "written": 0},
        BUF_V: {"read": heads * keys * p["Ev"] * es, "written": 0},
        BUF_OUT: {"read": 0, "written": heads * p["L"] * p["Ev"] * es},
        BUF_LSE: {"read": 0, "written": heads * p["L"] * 4},
    }
    if d.constants[FC_MASK]:
        reads = sum(rows * min(bk, p["S"] - k0) for _, rows, t in blocks for k0 in t)
        buffers[BUF_MASK] = {"read": heads * reads * mask_es, "written": 0}
    if d.constants[FC_SINKS]:
        buffers[BUF_SINKS] = {"read": heads * len(blocks) * THREADS * sinks_es, "written": 0}
    simdgroups = THREADS // 32
    mma = heads * tiles * simdgroups * (bk // 8) * (de // 8 + dv // 8)
    return buffers, mma, tiles, len(blocks) * -(-p["S"] // bk)


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


def backward_mma(plan, batch, es):
    """Predicted MMAs of each dispatch of an "sdpa_backward" plan (backward.h's loops): dK/dV
    visits, per 32-key block and query head of its group, the query tiles that see the block,
    with four products a tile (S^T, dV, dP^T, dK); dQ visits the forward's key tiles with three
    (S, dP, dQ). The pre-pass and dsinks use none."""
    out = []
    for d in plan.dispatches:
        if "_dkdv_" not in d.kernel and "_dq_" not in d.kernel:
            out.append(0)
            continue
        p = params(d, BUF_BWD_PARAMS)
        de, dv = (int(x[1:]) for x in d.kernel.split("_")[-2:])
        bk = bk_of(de, dv, es)
        td, tv, tk = de // 8, dv // 8, bk // 8
        sg = THREADS // 32
        if "_dq_" in d.kernel:
            tiles = sum(
                len(t)
                for _, _, t in visited_tiles(p, bk, d.constants[FC_HAS_HI], d.constants[FC_HAS_LO])
            )
            out.append(batch * p["Hq"] * tiles * sg * tk * (2 * td + tv))
            continue
        tiles = 0
        for key0 in range(0, p["S"], 32):
            last_key = min(key0 + 32, p["S"]) - 1
            begin, end = 0, p["L"]
            if d.constants[FC_HAS_HI]:
                begin = max(0, key0 - p["shift"] - p["hi_off"])
            if d.constants[FC_HAS_LO]:
                end = min(p["L"], last_key - p["shift"] + p["lo_off"] + 1)
            tiles += (-(-end // bk) - begin // bk) if end > begin else 0
        out.append(batch * p["Hq"] * tiles * sg * tk * (2 * td + 2 * tv))
    return out


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


def sim_column(op, tensors, opts, predicted, mma):
    """(the simulator's MB, 1 if its counters disagree with the model else 0)."""
    _, counters = sim.run_op(op, tensors, opts, counters=True, checkers=False)
    got = counted(counters)
    column = f"{total(got) / 1e6:.3f}"
    if got == predicted and counters[0]["mma"] == mma:
        return column, 0
    print(f"  model {predicted} mma {mma}\n  sim   {got} mma {counters[0]['mma']}", file=sys.stderr)
    return column + " MISMATCH", 1


def traffic_table(dtype, sim_limit) -> int:
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
        opts = run_options(E, options)
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


def varlen_table(dtype, sim_limit) -> int:
    """The packed batch's traffic (model == simulator) against the sum of its sequences'
    minimums, and the dense plan of the batch padded to (max_seqlen_q, max_seqlen_k)."""
    es = torch.finfo(dtype).bits // 8
    run_sim = sim.available()
    failures = 0
    print(f"\nsteel varlen attention forward (one dispatch per packed batch), {dtype}; MB")
    print(f"{'batch':34} {'model MB':>9} {'min MB':>8} {'ratio':>6} {'sim MB':>9} "
          f"{'padded MB':>9} {'kMMA':>9} {'ideal':>9} {'tiles':>6}")  # fmt: skip
    for name, lq, lk, Hq, Hkv, E, options in VARLEN_SHAPES:
        opts = {**run_options(E, options), "max_seqlen_q": max(lq), "max_seqlen_k": max(lk)}
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
        dense = sim.plan("sdpa", [pq, pk, pv, None, None], run_options(E, options))
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
]  # fmt: skip


def decode_params(dispatch):
    """AttnDecodeParams (params.h): the forward's fields, then the split and the cache."""
    out = params(dispatch)
    raw = next(b.bytes for b in dispatch.bindings if b.index == BUF_PARAMS)
    names = ["splits", "split_keys", "heads_per_tg", "rows", "page_size", "pages", "max_pages",
             "table_stride", "row_block"]  # fmt: skip
    out.update(zip(names, struct.unpack_from("9i", raw, 312), strict=True))
    return out


def decode_block(d, p, add, i0, last, S, shift, bk, vec, es, mask_es, sinks_es):
    """One block of query rows i0..last of a sequence of S keys, for every partition and KV head
    (chunk) of the grid: adds its traffic with `add`, returns the key tiles it visits."""
    de, dv = (int(x[1:]) for x in d.kernel.split("_")[-2:])
    paged, split = d.constants[FC_PAGED], d.constants[FC_SPLIT]
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
            add(BUF_V, "read", keys * p["Ev"] * es)
            if paged:
                add(BUF_TABLE, "read", keys * (de // vec + dv // vec) * 4)
            if d.constants[FC_MASK]:
                add(BUF_MASK, "read", rows * keys * mask_es)
            if split:
                add(BUF_PART_O, "written", rows * p["Ev"] * 4)
                add(BUF_PART_ML, "written", rows * 2 * 4)
            else:
                if d.constants[FC_SINKS]:
                    add(BUF_SINKS, "read", THREADS * sinks_es)
                add(BUF_OUT, "written", rows * p["Ev"] * es)
                add(BUF_LSE, "written", rows * 4)
    return tiles


def decode_model(plan, seqs, es, mask_es, sinks_es):
    """Per dispatch of a decode plan, ({binding: {"read", "written"}}, MMAs), from decode.h's
    loops. `seqs` lists (L, S) per batch entry or sequence. Every threadgroup of the partial
    kernel reads its rows' q (each split again: q is small), the K and V rows of the key tiles
    of its partition that some row may see (bounded at S and the head dims), the mask of its
    rows there, one block-table entry per 16-byte chunk it loads (paged), and writes out and lse
    (one pass) or the fp32 partials; the merge reads each row's partials once. Every lane reads
    the cu_seqlens / seqused_k entries and the sink it needs."""
    d = plan.dispatches[0]
    p = decode_params(d)
    de, dv = (int(x[1:]) for x in d.kernel.split("_")[-2:])
    bk = bk_of(de, dv, es)
    vec = 16 // es
    varlen, paged, split = d.constants[FC_VARLEN], d.constants[FC_PAGED], d.constants[FC_SPLIT]
    buffers: dict[int, dict[str, int]] = {}

    def add(index, kind, n):
        entry = buffers.setdefault(index, {"read": 0, "written": 0})
        entry[kind] += n

    tiles = 0
    for L, S in seqs:
        if varlen:
            add(BUF_CU_Q, "read", d.grid[0] * d.grid[1] * THREADS * 2 * 4)
            add(BUF_SEQUSED if paged else BUF_CU_K, "read",
                d.grid[0] * d.grid[1] * THREADS * (1 if paged else 2) * 4)  # fmt: skip
        if L == 0:
            continue
        shift = (S - L if d.constants[FC_VARLEN_BR] else 0) if varlen else p["shift"]
        for i0 in range(0, L, p["row_block"]):
            tiles += decode_block(d, p, add, i0, min(i0 + p["row_block"], L) - 1, S, shift, bk,
                                  vec, es, mask_es, sinks_es)  # fmt: skip
    mma = tiles * (THREADS // 32) * (bk // 8) * (de // 8 + dv // 8)
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
    opts = run_options(E, {k: v for k, v in options.items() if k not in ("mask", "sinks")})
    sinks = torch.randn(Hq, dtype=torch.float32, device=device) if options.get("sinks") else None
    if page is None:
        q, k, v, _ = inputs(B, Hq, Hkv, L, S, E, E, None, dtype, device)
        mask = torch.rand(B, 1, L, S, device=device) > 0.2 if options.get("mask") else None
        return [q, k, v, mask, sinks], opts, [(L, S)] * B
    used = [max(1, S * (b + 1) // B) for b in range(B)]
    need = [-(-n // page) for n in used]
    pool = sum(need)
    k = torch.randn(pool, page, Hkv, E, dtype=dtype, device=device)
    v = torch.randn(pool, page, Hkv, E, dtype=dtype, device=device)
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
        cache = sum(2 * Hkv * n * E * es for _, n in seqs)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--sim-limit", type=float, default=3e8,
                        help="run the simulator where B*H*L*S*(E+Ev) is at most this")  # fmt: skip
    parser.add_argument("--mps", action="store_true", help="time against F.sdpa on MPS")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    failures = traffic_table(dtype, args.sim_limit) + varlen_table(dtype, args.sim_limit)
    failures += decode_table(dtype, args.sim_limit)
    if args.mps and torch.backends.mps.is_available():
        mps_table(dtype, args.iters)
        decode_mps_table(dtype, args.iters)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
