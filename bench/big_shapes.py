"""Shapes over the simulation budget in bench --predict (issue 24): their counters without
simulating them whole.

A sampled run (part 24B's sample=) still simulates whole threadgroups and waves, and at prefill
L >= 4096 or a 4096^3 GEMM one threadgroup alone is tens of millions of multiply-adds. So these
shapes are predicted from two pieces, each an assumption stated here and checked in
tests/sim/test_bench_predict.py (test_fitted_counters_*, test_reuse_model_*):

1. Work counters, fitted (fit_counters): the same kernels (names, threads and function
   constants equal, else the shape is skipped) run on a family of small shapes of the same
   kind, and every counter is the polynomial through those points, evaluated at the big shape.
   - Attention (L = S = n, one KV head group): a threadgroup's counters are a per-block part plus
     a per-visited-key-tile part, and the blocks grow as n, the visited tiles as n^2 (causal
     too, at multiples of the tiles), so every counter is a quadratic in n: three points of n, a
     multiple of every tile, give it exactly.
   - GEMM (aligned to the tiles): every threadgroup does the same work per k step, so its
     counters are linear in K: two values of K on a small M x N of the same kernel, scaled by
     the big grid's threadgroups over the small one's.
   The test checks the fit against a whole run of a mid-size shape: equal counters.
2. DRAM bytes, from a reuse model (reuse_dram) instead of the cache model's replay: each
   threadgroup reads pieces of its tensors in order (attention: its own query rows, and K/V in
   chunks of key rows, the causal ones up to its diagonal; the backward's dK/dV blocks the
   query-side rows after theirs; GEMM: its band of A rows and of B columns, in steps of K),
   then writes its share of the dispatch's written bytes. Threadgroups are resident in waves
   in dispatch order as in the cache model; within a wave they run in lockstep, their traces
   interleaved piece by piece, through one LRU of the system-level cache's size: a piece it
   holds is not read again (so one that several threadgroups of a wave read comes from DRAM
   once), written bytes take room as the replay's write-allocate lines do (and are counted
   once, as written), and a wave whose footprint passes the LRU's size loses what LRU loses
   (a cyclic walk over more than it holds misses throughout). The tests compare it with the
   cache model's replay of whole mid-size runs of the forward, the backward's kernels and a
   GEMM, with caches small enough for K/V to be re-read, and bound the error (the bounds and
   the measured errors are stated there).
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

# Counters that are not sums over threadgroups (the fit keeps the first point's).
_KEEP = {"kernel", "sampled"}


def _lagrange(xs: Sequence[int], x: int) -> list[Fraction]:
    """Weights w_i with p(x) = sum w_i p(xs[i]) for every polynomial p of degree < len(xs)."""
    out = []
    for i, xi in enumerate(xs):
        w = Fraction(1)
        for j, xj in enumerate(xs):
            if j != i:
                w *= Fraction(x - xj, xi - xj)
        out.append(w)
    return out


def interpolate(samples: Sequence[Mapping[str, Any]], weights: Sequence[Fraction]) -> dict:
    """The counters at the fitted point: each number the weighted sum of the samples' (rounded
    to an integer, never below 0), nested mappings alike; names from the first sample."""
    first = samples[0]
    out: dict[str, Any] = {}
    for key in {k for s in samples for k in s}:
        values = [s.get(key, 0) for s in samples]
        v0 = first.get(key, values[0])
        if key in _KEEP or isinstance(v0, (str, bool)) or v0 is None:
            out[key] = v0
        elif isinstance(v0, Mapping):
            out[key] = interpolate([v if isinstance(v, Mapping) else {} for v in values], weights)
        elif isinstance(v0, (int, float)):
            out[key] = max(0, round(sum(w * Fraction(v) for w, v in zip(weights, values))))
        else:
            out[key] = v0
    return out


def fit_counters(
    runs: Sequence[Sequence[Mapping[str, Any]]], xs: Sequence[int], x: int, scale: float = 1
) -> list[dict]:
    """Each dispatch's counters at x from its counters at xs (runs[i]: the dispatches' counters
    at xs[i]), the polynomial of degree len(xs) - 1 through them, times `scale`."""
    weights = _lagrange(xs, x)
    out = []
    for per_point in zip(*runs, strict=True):
        c = interpolate(per_point, weights)
        if scale != 1:
            c = _scaled(c, scale)
        c["sampled"] = {"extrapolated": True, "fitted": {"points": list(xs), "at": x}}
        out.append(c)
    return out


def _scaled(c: Mapping[str, Any], factor: float) -> dict:
    out: dict[str, Any] = {}
    for key, val in c.items():
        if key in _KEEP or key == "threadgroup_memory_bytes" or isinstance(val, (str, bool)):
            out[key] = val
        elif isinstance(val, Mapping):
            out[key] = _scaled(val, factor)
        elif isinstance(val, (int, float)):
            out[key] = round(val * factor)
        else:
            out[key] = val
    return out


# --- the reuse model -------------------------------------------------------------------------

Piece = tuple[Any, int]  # (key, bytes)


def reuse_dram(
    threadgroups: int,
    resident: int,
    capacity: int,
    pieces_of: Callable[[int], Iterable[Piece]],
    written: float = 0,
) -> int:
    """Bytes read from DRAM: threadgroups in waves of `resident` in linear-id order, each
    reading pieces_of(id) in that order and then writing `written` bytes (the dispatch's
    written bytes over its threadgroups). A wave's threadgroups run in lockstep: their traces
    are interleaved piece by piece (the first piece of each, then the second, ...; a trace that
    ends drops out), through one LRU of `capacity` bytes that lasts the dispatch. A piece it
    holds is not read again (so one that several threadgroups of a wave read comes from DRAM
    once); written bytes are read from nowhere but take room, as the cache model's
    write-allocate lines do (see the module's docstring)."""
    cache: OrderedDict[Any, int] = OrderedDict()
    held = total = 0
    for start in range(0, threadgroups, resident):
        ids = range(start, min(start + resident, threadgroups))
        traces = [list(pieces_of(t)) for t in ids]
        if written:
            for t, trace in zip(ids, traces, strict=True):
                trace.append(((_WRITTEN, t), round(written)))
        for step in range(max(map(len, traces), default=0)):
            for trace in traces:
                if step >= len(trace):
                    continue
                key, size = trace[step]
                if key in cache:
                    cache.move_to_end(key)
                    continue
                if key[0] != _WRITTEN:
                    total += size
                cache[key] = size
                held += size
                while held > capacity:
                    _, out = cache.popitem(last=False)
                    held -= out
    return total


# the key of a threadgroup's written bytes in reuse_dram
_WRITTEN = "written"


def _chunks(lo: int, hi: int, rows: int) -> range:
    """Chunk indices of `rows` rows that rows [lo, hi) touch."""
    return range(lo // rows, -(-hi // rows)) if hi > lo else range(0)


def attention_pieces(
    kernel: str, grid: Sequence[int], shape: Mapping[str, Any]
) -> Callable[[int], list[Piece]] | None:
    """pieces_of(threadgroup id) for one attention dispatch (steel's forward, decode-free
    backward kernels, PyTorch's prefill kernel), or None for a kernel it does not know.
    shape: B, Hq, Hkv, L, S, D, causal (top-left, L == S in the bench), es (bytes per element).
    Grids are (blocks, query heads, batch) with linear id = x + blocks (h + Hq b), and query
    head h reads KV head h // (Hq / Hkv)."""
    nx, ny = int(grid[0]), int(grid[1])
    L, S, D, es = shape["L"], shape["S"], shape["D"], shape["es"]
    group = shape["Hq"] // shape["Hkv"]
    causal = shape["causal"]
    chunk = max(32, S // 64)  # key (or query) rows per piece: at most ~64 pieces per block

    def where(t):
        x, rest = t % nx, t // nx
        return x, rest % ny, rest // ny

    if re.match(r"(steel_attention_(tensor_)?(f16|bf16|f32)_e\d+_v\d+|prefill_attention_)", kernel):
        bq = -(-L // nx)

        def forward(t):
            x, h, b = where(t)
            hi = min(S, (x + 1) * bq) if causal else S
            kv = (b, h // group)
            out = [(("q", b, h, x), bq * D * es)]
            out += [(("kv", kv, c), 2 * chunk * D * es) for c in _chunks(0, hi, chunk)]
            return out

        return forward
    if re.match(r"steel_attention_bwd_(tensor_)?dq_", kernel):
        bq = -(-L // nx)

        def dq(t):
            x, h, b = where(t)
            hi = min(S, (x + 1) * bq) if causal else S
            own = bq * (2 * D * es + 8)  # q and dO rows, lse and delta (fp32)
            out = [(("q", b, h, x), own)]
            out += [(("kv", (b, h // group), c), 2 * chunk * D * es) for c in _chunks(0, hi, chunk)]
            return out

        return dq
    if re.match(r"steel_attention_bwd_(tensor_)?dkdv_", kernel):
        bk = -(-S // nx)

        def dkdv(t):
            x, h, b = where(t)
            lo = x * bk if causal else 0
            out = [(("kv", b, h // group, x), 2 * bk * D * es)]
            row = 2 * D * es + 8  # q and dO rows, lse and delta
            out += [(("q", b, h, c), chunk * row) for c in _chunks(lo, L, chunk)]
            return out

        return dkdv
    if kernel.startswith("steel_attention_bwd_delta_"):
        rows = -(-L // nx)

        def delta(t):
            x, h, b = where(t)
            return [(("od", b, h, x), 2 * rows * D * es)]  # O and dO rows

        return delta
    return None


def gemm_pieces(
    kernel: str, grid: Sequence[int], shape: Mapping[str, Any]
) -> Callable[[int], list[Piece]] | None:
    """pieces_of(threadgroup id) for steel's GEMM (shaders/steel/gemm/gemm.h: the grid is
    (tiles_n << swizzle, ceil(tiles_m >> swizzle), batch); tile_n = x >> swizzle, tile_m =
    (y << swizzle) + (x & (2^swizzle - 1))): its bm x K band of A and K x bn band of B, in
    pieces of `chunk` steps of K, the two bands' pieces of one step together (the order the
    kernel walks them)."""
    m = re.search(r"_bm(\d+)_bn(\d+)_", kernel)
    if not kernel.startswith("steel_gemm_") or not m:
        return None
    bm, bn = int(m.group(1)), int(m.group(2))
    M, N, K, es = shape["M"], shape["N"], shape["K"], shape["es"]
    gx, gy = int(grid[0]), int(grid[1])
    swizzle = int(math.log2(gx // -(-N // bn)))
    chunk = max(64, K // 64)  # K per piece: at most ~64 steps of each band

    def pieces(t):
        x, rest = t % gx, t // gx
        y, batch = rest % gy, rest // gy
        tile_n, tile_m = x >> swizzle, (y << swizzle) + (x & ((1 << swizzle) - 1))
        if tile_m * bm >= M:
            return []
        rows = min(bm, M - tile_m * bm)
        cols = min(bn, N - tile_n * bn)
        out = []
        for c in _chunks(0, K, chunk):  # both bands, walked along K together
            depth = min(chunk, K - c * chunk)
            out += [
                (("a", batch, tile_m, c), rows * depth * es),
                (("b", tile_n, c), cols * depth * es),
            ]
        return out

    return pieces
