"""Quantized KV caches (torch_steel.kv), per format, for one decode step (L = 1, GQA):

err      the quantization error: the kernel's output over the quantized cache against fp16
         attention (float64 math) over the unquantized cache, max |diff| / max |reference|;
K/V MB   the bytes of K and V (codes, scales, mins) the simulator's counters see the decode
         kernel read, against the model: codes plus scales (and mins), each read once
         (B * Hkv * S rows, one threadgroup per KV head, one pass, both fixed); the fp16 row
         is the unquantized decode kernel over the same cache;
x fp16   that figure over the fp16 cache's;
us       sim.predict's time on each chip (the timing model, torch_steel/sim/timing.py: its
         own assumptions and calibration, see docs/performance.md; a model's figure).

python bench/bench_kv.py [--S 1024] [--chips M1 M4 M5]

The end-to-end drift of a tiny model's logits per format: bench/bench_kv_model.py.
"""

import argparse
import math

import torch
import torch.nn.functional as F

from torch_steel import kv, sim

FORMATS = ["int8", "int8_g32", "int8_g64", "int8_g128", "q4_g32", "q4_g64"]
K_BUF, V_BUF, SCALE_BUFS = 1, 2, (14, 15, 16, 17)


def options(E, group, fmt=None):
    # One pass with the whole GQA group in a threadgroup, so that K and V are read once: the
    # planner's own pick may spread a group over threadgroups at few keys (docs/attention.md,
    # "Short caches"), which re-reads them, the same for every format.
    base = {"dropout_p": 0.0, "is_causal": False, "scale": 1 / math.sqrt(E), "softcap": 0.0,
            "window_left": -1, "window_right": -1, "bottom_right": False,
            "num_splits": 1, "decode_heads_per_tg": group}  # fmt: skip
    return base if fmt is None else {**base, "k_format": fmt, "v_format": fmt}


def model_bytes(x):
    """Codes plus scales plus mins of one quantized operand: each element read once."""
    return sum(t.numel() * t.element_size() for t in x.tensors() if t is not None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--Hq", type=int, default=8)
    ap.add_argument("--Hkv", type=int, default=2)
    ap.add_argument("--S", type=int, default=1024)
    ap.add_argument("--E", type=int, default=128)
    ap.add_argument("--chips", nargs="*", default=["M1", "M4 Pro", "M5"])
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(a.B, a.Hq, 1, a.E, generator=g).half()
    k = torch.randn(a.B, a.Hkv, a.S, a.E, generator=g).half()
    v = torch.randn(a.B, a.Hkv, a.S, a.E, generator=g).half()
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    fp16 = [q, k, v, None, None]
    group = a.Hq // a.Hkv
    _, c = sim.run_op("sdpa", fp16, options(a.E, group), counters=True, checkers=False)
    fp16_bytes = c[0]["buffers"][K_BUF]["read"] + c[0]["buffers"][V_BUF]["read"]
    print(f"decode step B={a.B} Hq={a.Hq} Hkv={a.Hkv} S={a.S} E={a.E}, fp16 queries, fp16 scales")
    head = f"{'format':10} {'err':>9} {'K/V MB':>8} {'model MB':>9} {'x fp16':>7}"
    print(head + "".join(f" {chip + ' us':>10}" for chip in a.chips))
    rows = [("fp16", "sdpa", fp16, options(a.E, group), fp16_bytes, 2 * k.numel() * 2, None)]
    for fmt in FORMATS:
        kq, vq = kv.quantize(k, fmt), kv.quantize(v, fmt)
        tensors = [q, *kq.tensors(), *vq.tensors(), None, None]
        rows.append((fmt, "sdpa_quantized", tensors, options(a.E, group, fmt), None,
                     model_bytes(kq) + model_bytes(vq), None))  # fmt: skip
    for name, op, tensors, opts, counted, model, _ in rows:
        outs, c = sim.run_op(op, tensors, opts, counters=True, checkers=False)
        if counted is None:
            bufs = c[0]["buffers"]
            counted = sum(bufs[i]["read"] for i in (K_BUF, V_BUF, *SCALE_BUFS) if i in bufs)
        err = float((outs[0].double() - ref).abs().max() / ref.abs().max())
        times = [sim.predict(op, tensors, opts, chip=chip)["time_s"] * 1e6 for chip in a.chips]
        mark = "" if counted == model else " MISMATCH"
        cells = "".join(f" {t:10.1f}" for t in times)
        print(f"{name:10} {err:9.2e} {counted / 1e6:8.3f} {model / 1e6:9.3f} "
              f"{counted / fp16_bytes:7.3f}{cells}{mark}")  # fmt: skip


if __name__ == "__main__":
    main()
