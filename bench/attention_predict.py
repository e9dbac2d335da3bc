"""bench_attention.py --predict: steel's attention against PyTorch's on one chip of the timing
model's table, predicted from simulator counters (issue 24, deliverable 5; side_by_side.py says
how each side is obtained).

Tables:
- prefill forward (L 512..16k, d64/128, causal or not, MHA and GQA 32/8): steel's forward against
  PyTorch's prefill kernel (PrefillAttention.h);
- decode (1 and 4 tokens, S 1k..32k, GQA 32/8 and MHA 32/32): steel's decode kernels against
  PyTorch's one-pass or two-pass vector kernels (DecodeAttention.h), as its host picks them;
- training step (forward + backward): steel's forward and backward kernels against F.sdpa with
  grad on MPS, which runs the composite math (PyTorch's _scaled_dot_product_attention_math),
  its kernels traced from torch itself (pytorch_composite.py) and modelled op by op at the
  roofline;
- varlen: one packed batch through steel's sdpa_varlen against PyTorch's kernels called once per
  sequence (PyTorch has no varlen attention on MPS);
FLOPs count the visible (row, key) pairs: 4 D per pair forward, 10 D backward.

After each chip's table, the matrix floor of the prefill and training rows: steel's matrix
products alone at the chip's matrix peak, the least time any kernel of this design takes in the
model, and PyTorch's time over it, the most steel's ratio can reach (matrix_floor).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytorch_composite
import side_by_side as sbs
import torch

# (name, B, Hq, Hkv, L, S, D, causal)
PREFILL = [
    (f"prefill L{L} d{D}{' causal' if c else ''}", 1, 8, 8, L, L, D, c)
    for D in (64, 128)
    for c in (False, True)
    for L in (512, 1024, 2048, 4096, 8192, 16384)
] + [(f"prefill GQA 32/8 L{L} d128 causal", 1, 32, 8, L, L, 128, True) for L in (1024, 4096)]
DECODE = [
    (f"decode {t} tok S{S // 1024}k {Hq}/{Hkv} d128", 1, Hq, Hkv, t, S, 128, False)
    for Hq, Hkv in ((32, 8), (32, 32))
    for t in (1, 4)
    for S in (1024, 4096, 16384, 32768)
]
TRAIN = [
    (f"train L{L} d{D} causal", 1, 8, 8, L, L, D, True)
    for D in (64, 128)
    for L in (512, 1024, 2048)
] + [("train GQA 32/8 L1024 d128 causal", 1, 32, 8, 1024, 1024, 128, True)]
# (name, lengths, Hq, Hkv, D, causal)
VARLEN = [("varlen 5 docs 100..2048 d128 causal", [512, 1024, 300, 2048, 100], 8, 8, 128, True)]

# --modest: docs/performance.md's table, every chip: the rows of issue 25's targets (prefill at
# L >= 1024, GQA >= 4 decode at S >= 4k, the training step at L >= 2048) and MHA decode
MODEST_PREFILL = [
    ("prefill L1024 d64 causal", 1, 8, 8, 1024, 1024, 64, True),
    ("prefill L1024 d128 causal", 1, 8, 8, 1024, 1024, 128, True),
    ("prefill L4096 d64 causal", 1, 8, 8, 4096, 4096, 64, True),
    ("prefill L4096 d128 causal", 1, 8, 8, 4096, 4096, 128, True),
]
MODEST_DECODE = [
    ("decode 1 tok S4k 32/8 d128", 1, 32, 8, 1, 4096, 128, False),
    ("decode 1 tok S16k 32/8 d128", 1, 32, 8, 1, 16384, 128, False),
    ("decode 4 tok S16k 32/8 d128", 1, 32, 8, 4, 16384, 128, False),
    ("decode 1 tok S16k 32/32 d128", 1, 32, 32, 1, 16384, 128, False),
]
MODEST_TRAIN = [
    ("train L1024 d64 causal", 1, 8, 8, 1024, 1024, 64, True),
    ("train L2048 d64 causal", 1, 8, 8, 2048, 2048, 64, True),
    ("train L2048 d128 causal", 1, 8, 8, 2048, 2048, 128, True),
]
MODEST_VARLEN = [("varlen 100,300,512 d64 causal", [100, 300, 512], 8, 8, 64, True)]

QUICK_PREFILL = [("prefill L80 d64 GQA 2/1 causal", 1, 2, 1, 80, 80, 64, True)]
QUICK_DECODE = [("decode 1 tok S256 4/1 d64", 1, 4, 1, 1, 256, 64, False)]
QUICK_TRAIN = [("train L40 d64 causal", 1, 2, 2, 40, 40, 64, True)]
QUICK_VARLEN = [("varlen 33,17 d64", [33, 17], 2, 1, 64, False)]


# Matrix products per visible (row, key) pair and head-dim column in steel's kernels: the
# forward takes S = Q K^T and O = P V; the backward's dK/dV kernel recomputes S and takes dP =
# dO V^T, dV = P^T dO and dK = dS^T Q, and its dQ kernel recomputes S and dP for dQ = dS K
# (tests/sim/test_bench_predict.py counts the MMAs of each kernel against these).
FORWARD_MATMULS = 2
BACKWARD_MATMULS = 7


def matrix_floor(shape, chip, dtype, matmuls, dispatches):
    """Seconds of `matmuls` products over the visible pairs of `shape` (a PREFILL or TRAIN row)
    at the chip's matrix peak, plus the dispatch overhead of each of `dispatches`: the timing
    model predicts no dispatch below its MMAs at the peak and its overhead, so no kernel that
    runs these products is predicted faster."""
    _, B, Hq, _, L, S, D, causal = shape
    flops = 2 * matmuls * B * Hq * visible(L, S, causal) * D
    overhead = float(sbs.chip(chip)["dispatch_overhead_s"])
    return flops / sbs.roofline_peaks(chip, dtype)["matrix"] + dispatches * overhead


def visible(L, S, causal) -> int:
    """(row, key) pairs a top-left causal mask (PyTorch's is_causal) lets rows see."""
    if not causal:
        return L * S
    return sum(min(S, i + 1) for i in range(L))


def _options(D, causal, **extra):
    return {
        "dropout_p": 0.0,
        "is_causal": causal,
        "scale": 1 / math.sqrt(D),
        "softcap": 0.0,
        "window_left": -1,
        "window_right": -1,
        "bottom_right": False,
        **extra,
    }


def _qkv(B, Hq, Hkv, L, S, D, dtype, device):
    g = torch.Generator().manual_seed(L * 7 + S)
    if device == "meta":
        return [torch.empty(*s, dtype=dtype, device="meta") for s in
                ((B, Hq, L, D), (B, Hkv, S, D), (B, Hkv, S, D))]  # fmt: skip
    return [torch.randn(*s, generator=g).to(dtype) for s in
            ((B, Hq, L, D), (B, Hkv, S, D), (B, Hkv, S, D))]  # fmt: skip


def _reduce(B, Hq, Hkv):
    """(B, Hq, Hkv) of one KV head group, and the factor back. Heads only: steel's kernels read
    more of the params struct in batch entries past the first, so the batch is kept."""
    return (B, Hq // Hkv, 1), Hkv


def forward_pair(shape, dtype, chip, budget):
    """(steel, PyTorch) predictions of one F.sdpa forward."""
    _, B, Hq, Hkv, L, S, D, causal = shape
    (rb, rh, rkv), factor = _reduce(B, Hq, Hkv)

    def make_steel(device, reduced):
        dims = (rb, rh, rkv) if reduced else (B, Hq, Hkv)
        return [*_qkv(*dims, L, S, D, dtype, device), None, None]

    work = rh * visible(L, S, causal) * 2 * D
    fit = _attention_fit(shape, dtype, lambda n: _maker(B, Hq, Hkv, rb, rh, rkv, n, D, dtype))
    ours = sbs.steel_records(
        "sdpa", make_steel, _options(D, causal), factor, chip, budget, work, fit
    )

    def make_torch(reduced):
        if reduced:
            q, k, v = _qkv(rb, rh, rkv, L, S, D, dtype, "cpu")
        else:  # the full shape gives only the launches' geometry: no values needed
            q, k, v = (
                torch.empty(t.shape, dtype=dtype) for t in _qkv(B, Hq, Hkv, L, S, D, dtype, "meta")
            )
        return q, k, v, {"causal": causal}

    def torch_at(n):
        def make(reduced):
            return (*_qkv(rb, rh, rkv, n, n, D, dtype, "cpu"), {"causal": causal})

        return make

    fit_torch = _attention_fit(shape, dtype, torch_at)
    theirs = sbs.pytorch_records(make_torch, factor, chip, budget, work, fit_torch)
    return ours, theirs


# Fitted shapes (big_shapes.py): L = S = n at these points, multiples of every tile (BQ <= 64,
# BK <= 32), give each counter's quadratic in n exactly.
FIT_POINTS = (128, 256, 384)


def _maker(B, Hq, Hkv, rb, rh, rkv, n, D, dtype):
    def make(device, reduced):
        dims = (rb, rh, rkv) if reduced else (B, Hq, Hkv)
        return [*_qkv(*dims, n, n, D, dtype, device), None, None]

    return make


def _attention_fit(shape, dtype, make_at, work_factor=1.0):
    """The fit= of sbs.steel_records for an L = S attention shape (None when L != S), DRAM from
    the reuse model (checked against the cache model's replay for the forward and the
    backward's kernels in tests/sim/test_bench_predict.py)."""
    import big_shapes  # noqa: PLC0415

    _, B, Hq, Hkv, L, S, D, causal = shape
    if L != S or L <= max(FIT_POINTS):
        return None
    geometry = {"B": B, "Hq": Hq, "Hkv": Hkv, "L": L, "S": S, "D": D, "causal": causal,
                "es": sbs._ES[dtype]}  # fmt: skip
    rh = Hq // Hkv
    return {
        "points": FIT_POINTS,
        "x": L,
        "make_at": make_at,
        "reduced": True,
        "work_at": lambda n: work_factor * rh * visible(n, n, causal) * 2 * D,
        "scale": lambda full, small: 1,
        "pieces": lambda kernel, grid: big_shapes.attention_pieces(kernel, grid, geometry),
    }


def _backward_inputs(B, Hq, Hkv, L, D, dtype, device):
    """sdpa_backward's inputs at L = S (dO, q, k, v, out, lse, ...): random values; the lse of
    a uniform row."""
    q, k, v = _qkv(B, Hq, Hkv, L, L, D, dtype, device)
    out = torch.randn(q.shape, device=device).to(dtype) if device != "meta" else q
    lse = torch.zeros(q.shape[:3], dtype=torch.float32, device=device)
    if device != "meta":
        lse += float(math.log(L))
    return [torch.randn(q.shape, device=device).to(dtype) if device != "meta" else q,
            q, k, v, out, lse, None, None, None]  # fmt: skip


def training_pair(shape, dtype, chip, budget):
    """(steel forward + backward, PyTorch's composite forward + backward)."""
    _, B, Hq, Hkv, L, S, D, causal = shape
    (rb, rh, rkv), factor = _reduce(B, Hq, Hkv)
    work = rh * visible(L, S, causal) * 2 * D
    opts = _options(D, causal)

    def make_fwd(device, reduced):
        dims = (rb, rh, rkv) if reduced else (B, Hq, Hkv)
        return [*_qkv(*dims, L, S, D, dtype, device), None, None]

    def make_bwd(device, reduced):
        dims = (rb, rh, rkv) if reduced else (B, Hq, Hkv)
        return _backward_inputs(*dims, L, D, dtype, device)

    def fwd_at(n):
        return _maker(B, Hq, Hkv, rb, rh, rkv, n, D, dtype)

    def bwd_at(n):
        return lambda device, reduced: _backward_inputs(
            *((rb, rh, rkv) if reduced else (B, Hq, Hkv)), n, D, dtype, device
        )

    fit_fwd = _attention_fit(shape, dtype, fwd_at)
    fit_bwd = _attention_fit(shape, dtype, bwd_at, work_factor=2.5)
    fwd = sbs.steel_records("sdpa", make_fwd, opts, factor, chip, budget, work, fit_fwd)
    bwd = sbs.steel_records(
        "sdpa_backward", make_bwd, opts, factor, chip, budget, 2.5 * work, fit_bwd
    )
    if "skipped" in fwd or "skipped" in bwd:
        ours = fwd if "skipped" in fwd else bwd
    else:
        ours = {
            "time_s": fwd["time_s"] + bwd["time_s"],
            "bound": f"{bwd['bound']} (bwd)",
            "dispatches": fwd["dispatches"] + bwd["dispatches"],
            "how": fwd["how"] if fwd["how"] == bwd["how"] else f"{fwd['how']}; bwd {bwd['how']}",
        }
    theirs = sbs.composite_time(composite_training_ops(B, Hq, Hkv, L, S, D, causal, 0.0, dtype),
                                chip, dtype)  # fmt: skip
    theirs["how"] = "composite math, op roofline"
    return ours, theirs


def composite_training_ops(B, Hq, Hkv, L, S, D, causal, dropout_p, dtype):
    """The kernels of F.sdpa's math path with grad (forward, then autograd's backward), each with
    its FLOPs and bytes, traced from torch's own _scaled_dot_product_attention_math on meta
    tensors (pytorch_composite.py says how and what counts)."""
    return pytorch_composite.sdpa_training_ops(B, Hq, Hkv, L, S, D, causal, dropout_p, dtype)


def varlen_pair(shape, dtype, chip, budget):
    """(steel's one sdpa_varlen dispatch, PyTorch's kernels once per sequence)."""
    _, lengths, Hq, Hkv, D, causal = shape
    rh = Hq // Hkv
    total = sum(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    opts = _options(D, causal, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
    work = rh * sum(visible(n, n, causal) for n in lengths) * 2 * D

    def make_steel(device, reduced):
        hq, hkv = (rh, 1) if reduced else (Hq, Hkv)
        g = torch.Generator().manual_seed(total)
        shapes = ((total, hq, D), (total, hkv, D), (total, hkv, D))
        if device == "meta":
            q, k, v = (torch.empty(*s, dtype=dtype, device="meta") for s in shapes)
        else:
            q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in shapes)
        return [q, k, v, cu, cu.clone(), None]

    ours = sbs.steel_records("sdpa_varlen", make_steel, opts, Hkv, chip, budget, work)
    parts = []
    for n in lengths:
        shape1 = (f"seq {n}", 1, Hq, Hkv, n, n, D, causal)
        parts.append(forward_pair(shape1, dtype, chip, budget)[1])
    if any("skipped" in p for p in parts):
        theirs = next(p for p in parts if "skipped" in p)
    else:
        longest = max(parts, key=lambda p: p["time_s"])
        theirs = {
            "time_s": sum(p["time_s"] for p in parts),
            "bound": longest["bound"],
            "dispatches": [d for p in parts for d in p["dispatches"]],
            "how": f"{len(parts)} calls, heads reduced",
        }
    return ours, theirs


def run(chips, dtype, quick, out_dir: Path, budget: float, modest=False) -> list[str]:
    """Print the tables for each chip and save the plots; returns the table lines (for tests).
    quick: one tiny shape of each kind; modest: docs/performance.md's set."""
    lines: list[str] = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    prefill, decode, train, varlen = (
        (QUICK_PREFILL, QUICK_DECODE, QUICK_TRAIN, QUICK_VARLEN)
        if quick
        else (MODEST_PREFILL, MODEST_DECODE, MODEST_TRAIN, MODEST_VARLEN)
        if modest
        else (PREFILL, DECODE, TRAIN, VARLEN)
    )
    for chip in chips:
        say(f"\n== {chip}: predicted time, steel against PyTorch 2.13 (ratio = PyTorch / steel), "
            f"{dtype}")  # fmt: skip
        source = "cache model" if sbs.cache_model_available() else "tensors' device bytes"
        say(f"   DRAM bytes: {source}; how: heads reduced / sampled / full (side_by_side.py)")
        say(sbs.HEADER)
        series: dict[str, list] = {}
        floors: list[str] = []
        for kind, shapes, pair, fl in (
            ("prefill", prefill, forward_pair, 4),
            ("decode", decode, forward_pair, 4),
            ("train", train, training_pair, 14),
        ):
            for shape in shapes:
                _, B, Hq, _, L, S, D, causal = shape
                flops = fl * B * Hq * visible(L, S, causal) * D
                ours, theirs = pair(shape, dtype, chip, budget)
                say(sbs.row(shape[0], flops, ours, theirs))
                matmuls = {"prefill": FORWARD_MATMULS,
                           "train": FORWARD_MATMULS + BACKWARD_MATMULS}.get(kind)  # fmt: skip
                if matmuls and "time_s" in ours and "time_s" in theirs:
                    floor = matrix_floor(shape, chip, dtype, matmuls, len(ours["dispatches"]))
                    floors.append(
                        f"{shape[0]:34} {floor * 1e6:10.1f} {ours['time_s'] / floor:9.2f}x "
                        f"{theirs['time_s'] / floor:11.2f}x"
                    )
                if kind == "prefill":
                    gqa = f" GQA {Hq}/{shape[3]}" if Hq != shape[3] else ""
                    label = f"d{D}{' causal' if causal else ''}{gqa}"
                    for side, r in (("steel", ours), ("PyTorch", theirs)):
                        if "time_s" in r:
                            series.setdefault(f"{side} {label}", []).append(
                                (L, flops / r["time_s"] / 1e12,
                                 sbs.dram_bytes(r) / r["time_s"] / 1e9))  # fmt: skip
        for shape in varlen:
            _, lengths, Hq, _, D, causal = shape
            flops = 4 * Hq * sum(visible(n, n, causal) for n in lengths) * D
            ours, theirs = varlen_pair(shape, dtype, chip, budget)
            say(sbs.row(shape[0], flops, ours, theirs))
        if floors:
            say(f"\n   matrix floor: steel's matrix products alone at {chip}'s matrix peak "
                "(matrix_floor)")  # fmt: skip
            say(f"{'shape':34} {'floor us':>10} {'steel/floor':>10} {'ratio at most':>12}")
            for line in floors:
                say(line)
        path = sbs.plot(out_dir / f"attention_{chip.replace(' ', '_')}.png", chip, series,
                        sbs.roofline_peaks(chip, dtype))  # fmt: skip
        if path is not None:
            say(f"plot: {path}")
    return lines
