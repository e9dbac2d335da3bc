"""The attention kernels over quantized K/V (torch_steel.kv) in the Metal simulator, checkers on:
the decode kernels (one pass and split-K; dense, packed varlen and paged) and the prefill
kernel (dense and varlen), with K and V dequantized by AttnQuantTileLoader on the way into
threadgroup memory (plan: mps_src/plan/quantized_plan.cpp).

The oracle is float64 attention (torch_steel.reference) over the cache dequantized into the
query's dtype: x = q * s (+ m) computed in float32 and rounded once to the compute dtype, which
is what the loader writes into its tile. So the kernel and the oracle attend to the same K and V
values and the fp16 path's tolerance applies (attn_helpers.assert_attention_close): a wrong
scale, min, nibble or row is far outside it, while quantization error, which both share, does
not enter (bench/bench_kv.py reports that one). Every call is strict (a refused plan fails the
test) and asserts which kernel served it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "attn"))
from attn_helpers import (  # noqa: E402
    DTYPES,
    FC_DECODE_DIRECT,
    assert_attention_close,
    oracle,
    requires_simulator,
    score_error,
    strict,
)

import torch_steel  # noqa: E402
from torch_steel import kv, sim  # noqa: E402
from torch_steel.kv import QuantizedKV  # noqa: E402
from torch_steel.ops import attention_ops  # noqa: E402

pytestmark = requires_simulator

# Every format on K and on V, each with another on the other side.
PAIRS = [
    ("int8", "q4_g32"),
    ("int8_g32", "int8_g128"),
    ("int8_g64", "q4_g64"),
    ("q4_g32", "int8"),
    ("q4_g64", "int8_g64"),
    ("int8_g128", "int8_g32"),
]


def _x(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _cache(shape, fmt, seed, scale_dtype=torch.float16):
    return kv.quantize(_x(*shape, seed=seed), fmt, scale_dtype)


def _attn(q, is_causal=False, scale=None, sinks=None, softcap=None, window=None,
          causal_align="top_left", num_splits=0):  # fmt: skip
    attn = attention_ops._resolve("sdpa", q.shape[-1], 0.0, is_causal, scale, sinks, softcap,
                                  window, causal_align, None, 0)  # fmt: skip
    return attn._replace(num_splits=num_splits)


def steel_dense(q, kq, vq, mask=None, num_splits=0, **kw):
    """(out, lse, kernel names, grid x of the first dispatch) of steel::sdpa_quantized_forward on
    the sim backend, strict."""
    attn = _attn(q, num_splits=num_splits, **kw)
    tensors = [q, *kq.tensors(), *vq.tensors(), mask, attn.sinks]
    options = attn.run_options(k_format=kq.format, v_format=vq.format)
    p = sim.plan("sdpa_quantized", tensors, options)
    assert p.ok, p.reason
    with strict(), torch_steel.backend("sim"):
        out, lse = torch.ops.steel.sdpa_quantized_forward(
            q, *kq.tensors(), *vq.tensors(), kq.format, vq.format, mask, *attn
        )
    return out, lse, [d.kernel for d in p.dispatches], p.dispatches[0].grid[0]


def dequantized(x, dtype):
    """The cache as the loader puts it in its tile: float32 math, one rounding to dtype."""
    return x.dequantize(dtype)


def check_dense(q, kq, vq, mask=None, num_splits=0, **kw):
    out, lse, kernels, grid_x = steel_dense(q, kq, vq, mask, num_splits, **kw)
    kd, vd = dequantized(kq, q.dtype), dequantized(vq, q.dtype)
    ref_out, ref_lse = oracle(q, kd, vd, mask, enable_gqa=True, **kw)
    v_max = float(vd.double().abs().max())
    assert_attention_close(out, lse, ref_out, ref_lse, q.dtype, v_max,
                           score_error(q, kd, kw.get("scale")))  # fmt: skip
    return kernels, grid_x


@pytest.mark.parametrize("k_format,v_format", PAIRS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_every_format_one_pass_and_split(k_format, v_format, dtype):
    """GQA decode (8 query heads on 2 KV heads, L = 2: 8 packed rows, the vector kernel's) over
    S = 161 keys (S % 32 = 1), K's scales float16, V's float32; one pass and three partitions."""
    q = _x(1, 8, 2, 128, seed=1).to(dtype)
    kq = _cache((1, 2, 161, 128), k_format, 2, torch.float16)
    vq = _cache((1, 2, 161, 128), v_format, 3, torch.float32)
    for splits in (1, 3):
        kernels, grid_x = check_dense(q, kq, vq, num_splits=splits)
        assert kernels[0] == f"steel_attention_decode_vector_{attention_dtype(dtype)}_e128_v128"
        assert grid_x == splits and len(kernels) == (2 if splits > 1 else 1)


def attention_dtype(dtype):
    return {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]


@pytest.mark.parametrize(
    "E,Ev,k_format,v_format",
    [(64, 64, "q4_g64", "int8_g32"), (40, 40, "int8", "int8"), (192, 128, "int8_g64", "q4_g32"),
     (256, 256, "q4_g32", "int8_g128")],
)  # fmt: skip
def test_decode_head_dims_mha_ragged(E, Ev, k_format, v_format):
    """MHA (3 heads), L = 1 (the vector kernel), S = 95 (S % 32 = 31), head dims with and without
    padding: E = 40 is not a multiple of a 16-byte chunk of int8 codes (its rows are read byte
    by byte)."""
    q = _x(2, 3, 1, E, seed=4).half()
    kq = _cache((2, 3, 95, E), k_format, 5)
    vq = _cache((2, 3, 95, Ev), v_format, 6)
    kernels, _ = check_dense(q, kq, vq, num_splits=2)
    assert kernels[0].startswith("steel_attention_decode_vector_f16_")  # MHA: one packed row


def test_decode_options():
    """Causal bottom-right, a left window, sinks, softcap, a bool mask and an additive one."""
    q = _x(2, 4, 3, 64, seed=7).half()
    kq = _cache((2, 2, 97, 64), "int8_g32", 8)
    vq = _cache((2, 2, 97, 64), "q4_g32", 9)
    sinks = _x(4, seed=10).float()
    check_dense(q, kq, vq, is_causal=True, causal_align="bottom_right", window=(40, 0),
                sinks=sinks, num_splits=2)  # fmt: skip
    check_dense(q, kq, vq, softcap=20.0, num_splits=1)
    mask = _x(2, 1, 3, 97, seed=11) > -0.5
    check_dense(q, kq, vq, mask, num_splits=3)
    check_dense(q, kq, vq, _x(3, 97, seed=12).half(), scale=0.3)


def test_decode_strided_views():
    """A preallocated cache narrowed to its first 70 tokens (rows 128 tokens apart), the keys of a
    [B, S, H, E] cache transposed to [B, H, S, E], and codes one token into their storage with
    40-byte rows (no 16-byte alignment: the loader's byte path)."""
    q = _x(1, 4, 1, 64, seed=13).to(torch.bfloat16)
    cache = QuantizedKV.empty((1, 2, 128, 64), "q4_g64")
    kq = cache.append_(_x(1, 2, 70, 64, seed=14), 0)
    bshe = kv.quantize(_x(1, 70, 2, 64, seed=15), "int8_g64", torch.float32)
    vq = bshe.map(lambda t: t.transpose(1, 2))
    check_dense(q, kq, vq, num_splits=2)
    k40 = _cache((1, 2, 71, 40), "int8", 16).narrow(-2, 1, 70)
    v40 = _cache((1, 2, 71, 40), "int8", 17).narrow(-2, 1, 70)
    check_dense(q[..., :40].contiguous(), k40, v40, num_splits=1)


@pytest.mark.parametrize("k_format,v_format", [("int8_g64", "q4_g32"), ("q4_g64", "int8")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill(k_format, v_format, dtype):
    """L = 37 query rows (the prefill kernel) against S = 65 keys: causal bottom-right (chunked
    prefill attends to the cache before it), sinks, and plain."""
    q = _x(1, 4, 37, 64, seed=18).to(dtype)
    kq = _cache((1, 2, 65, 64), k_format, 19)
    vq = _cache((1, 2, 65, 64), v_format, 20, torch.float32)
    kernels, _ = check_dense(q, kq, vq, is_causal=True, causal_align="bottom_right",
                             sinks=_x(4, seed=21).float())  # fmt: skip
    assert kernels == [f"steel_attention_{attention_dtype(dtype)}_e64_v64"]
    check_dense(q, kq, vq)


def test_prefill_stays_on_simdgroup_kernels_on_m5():
    """On an M5-generation GPU the fp16 prefill runs on matmul2d; a quantized one keeps the
    simdgroup kernel, whose tile loader dequantizes (the plan's reason, quantized_plan.cpp)."""
    m5 = {"device_apple_family": 10, "device_metal4": True, "device_tensor_ops": True}
    q = _x(1, 2, 64, 64, seed=22).half()
    kq, vq = _cache((1, 2, 64, 64), "int8_g64", 23), _cache((1, 2, 64, 64), "q4_g64", 24)
    with sim.device(m5):
        kd = dequantized(kq, q.dtype)
        dense = sim.plan("sdpa", [q, kd, kd, None, None], _attn(q).run_options())
        assert dense.dispatches[0].kernel.startswith("steel_attention_tensor_")
        kernels, _ = check_dense(q, kq, vq)
    assert kernels == ["steel_attention_f16_e64_v64"]


@pytest.mark.parametrize("k_format,v_format", [("int8_g64", "int8"), ("q4_g32", "q4_g64")])
@pytest.mark.parametrize("vector", [1, 0])
def test_both_decode_kernels_dequantize(k_format, v_format, vector):
    """The vector decode kernel (the default for these 8 packed rows) and the MMA one (option
    decode_vector = 0) both stage quantized tiles through AttnDecodeBlock's dequantizing loads:
    each gives the dequantized cache's attention, one pass and split."""
    q = _x(1, 8, 2, 128, seed=25).half()
    kq, vq = _cache((1, 2, 161, 128), k_format, 26), _cache((1, 2, 161, 128), v_format, 27)
    kd, vd = dequantized(kq, q.dtype), dequantized(vq, q.dtype)
    ref_out, ref_lse = oracle(q, kd, vd, None, enable_gqa=True)
    for splits in (1, 3):
        attn = _attn(q, num_splits=splits)
        tensors = [q, *kq.tensors(), *vq.tensors(), None, attn.sinks]
        options = {**attn.run_options(k_format=kq.format, v_format=vq.format),
                   "decode_vector": vector}  # fmt: skip
        p = sim.plan("sdpa_quantized", tensors, options)
        assert p.ok, p.reason
        name = "steel_attention_decode_vector_" if vector else "steel_attention_decode_"
        assert p.dispatches[0].kernel == f"{name}f16_e128_v128"
        if vector:  # the dequantizing loaders stage the tiles: no direct reads
            assert p.dispatches[0].constants[FC_DECODE_DIRECT] is False
        out, lse = sim.run_op("sdpa_quantized", tensors, options, checkers=True)[:2]
        assert_attention_close(out, lse, ref_out, ref_lse, q.dtype, float(vd.double().abs().max()),
                               score_error(q, kd, None))  # fmt: skip


# ---- varlen and paged ----------------------------------------------------------------------


def _varlen_oracle(q, kd, vd, cu_q, cu_k, **kw):
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)
        ks, vs = (t[cu_k[b] : cu_k[b + 1]].transpose(0, 1) for t in (kd, vd))
        o, lse = oracle(qs, ks, vs, enable_gqa=True, **kw)
        outs.append(o.transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, -1)


def steel_varlen(q, kq, vq, cu_q, cu_k, max_q, max_k, **kw):
    with strict(), torch_steel.backend("sim"):
        return torch_steel.sdpa_varlen(q, kq, vq, cu_q, cu_k, max_q, max_k, return_lse=True, **kw)


def _lengths(lengths):
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("rows", [1, 20])  # decode kernels, prefill kernel
def test_varlen(rows):
    """Packed sequences of 33, 1 and 95 keys, int8_g32 keys and q4_g64 values, causal."""
    lq = [min(rows, n) for n in (33, 1, 95)]
    lk = [33, 1, 95]
    cu_q, cu_k = _lengths(lq), _lengths(lk)
    q = _x(sum(lq), 4, 64, seed=25).half()
    kq = _cache((sum(lk), 2, 64), "int8_g32", 26)
    vq = _cache((sum(lk), 2, 64), "q4_g64", 27, torch.float32)
    kw = {"is_causal": True, "causal_align": "bottom_right"}
    out, lse = steel_varlen(q, kq, vq, cu_q, cu_k, max(lq), max(lk), num_splits=2, **kw)
    kd, vd = dequantized(kq, q.dtype), dequantized(vq, q.dtype)
    ref_out, ref_lse = _varlen_oracle(q, kd, vd, cu_q.tolist(), cu_k.tolist(), **kw)
    assert_attention_close(out, lse, ref_out, ref_lse, q.dtype, float(vd.abs().max()),
                           score_error(q.transpose(0, 1), kd.transpose(0, 1)))  # fmt: skip


def _paged(used, page, H, E, k_format, v_format, seed):
    """Pools of shuffled pages holding sequences of `used` keys; the table, and the keys and
    values of each sequence in order (dequantized), for the oracle."""
    need = [-(-n // page) for n in used]
    pages = sum(need) + 1  # one page no sequence uses
    kq = _cache((pages, page, H, E), k_format, seed)
    vq = _cache((pages, page, H, E), v_format, seed + 1, torch.float32)
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
    table = torch.zeros(len(used), max(need), dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        table[b, :n] = order[i : i + n]
        i += n
    return kq, vq, table


@pytest.mark.parametrize("k_format,v_format", [("q4_g32", "int8_g64"), ("int8", "q4_g64")])
@pytest.mark.parametrize("rows", [1, 40])  # decode, a chunked prefill (blocks of 32 rows)
def test_paged(k_format, v_format, rows):
    """A paged pool (pages of 16 keys) read through a shuffled block table, sequences of 63, 1
    and 33 keys (ragged last pages), GQA, one pass and split."""
    used, page, H, E = [63, 1, 33], 16, 2, 64
    kq, vq, table = _paged(used, page, H, E, k_format, v_format, 28)
    lq = [min(rows, n) for n in used]
    cu_q = _lengths(lq)
    q = _x(sum(lq), 4, E, seed=29).half()
    seqused = torch.tensor(used, dtype=torch.int32)
    kd, vd = dequantized(kq, q.dtype), dequantized(vq, q.dtype)
    keys = [kd[table[b].long()].reshape(-1, H, E)[: used[b]] for b in range(len(used))]
    vals = [vd[table[b].long()].reshape(-1, H, E)[: used[b]] for b in range(len(used))]
    cu_k = _lengths(used).tolist()
    kw = {"is_causal": True, "causal_align": "bottom_right"}
    ref_out, ref_lse = _varlen_oracle(q, torch.cat(keys), torch.cat(vals), cu_q.tolist(), cu_k,
                                      **kw)  # fmt: skip
    for splits in (1, 2):
        out, lse = steel_varlen(q, kq, vq, cu_q, None, max(lq), max(used), block_table=table,
                                seqused_k=seqused, num_splits=splits, **kw)  # fmt: skip
        assert_attention_close(
            out,
            lse,
            ref_out,
            ref_lse,
            q.dtype,
            float(vd.abs().max()),
            score_error(q.transpose(0, 1), torch.cat(keys).transpose(0, 1)),
        )


# ---- the plan's refusals -------------------------------------------------------------------


def test_plan_refusals_name_the_problem():
    q = torch.zeros(1, 2, 1, 64, dtype=torch.float16)
    kq = _cache((1, 2, 9, 64), "int8_g32", 30)
    vq = _cache((1, 2, 9, 64), "q4_g32", 31)
    base = _attn(q).run_options(k_format="int8_g32", v_format="q4_g32")

    def reason(tensors, **options):
        p = sim.plan("sdpa_quantized", tensors, {**base, **options})
        assert not p.ok
        return p.reason

    good = [q, *kq.tensors(), *vq.tensors(), None, None]
    assert "unknown key format 'int4'" in reason(good, k_format="int4")
    bad = list(good)
    bad[1] = kq.data.view(torch.uint8)
    assert "int8_g32 key codes must be int8, got uint8" in reason(bad)
    bad = list(good)
    bad[2] = kq.scales[..., :1]
    assert "int8_g32 key scales must be [1, 2, 9, 2]" in reason(bad)
    bad = list(good)
    bad[6] = None
    assert "q4_g32 value mins must have the scales' shape" in reason(bad)
    bad = list(good)
    bad[3] = vq.mins
    assert "int8_g32 key takes no mins" in reason(bad)


# ---- bytes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "k_format,scale_dtype,per_value",
    [("int8_g64", torch.float16, 1 + 2 / 64), ("q4_g32", torch.float16, 0.5 + 4 / 32),
     ("int8", torch.float32, 1 + 4 / 128)],
)  # fmt: skip
def test_decode_step_reads_the_quantized_bytes(k_format, scale_dtype, per_value):
    """One decode step (L = 1, GQA group of 4 in one threadgroup, one pass; the packing fixed,
    since at 96 keys the planner would spread the group over threadgroups, each re-reading its
    KV head: docs/attention.md) reads each K and V code and each scale and min exactly once:
    the counters' bytes of the code, scale and min buffers are S * Hkv * E * (bits / 8) plus
    the scales' (and mins') bytes, e.g. int8 with one fp16 scale per 64 values is
    (1 + 2 / 64) / 2 = 0.52 of an fp16 cache's bytes."""
    B, Hkv, S, E = 1, 2, 96, 128
    q = _x(B, 4 * Hkv, 1, E, seed=32).half()
    kq = _cache((B, Hkv, S, E), k_format, 33, scale_dtype)
    vq = _cache((B, Hkv, S, E), k_format, 34, scale_dtype)
    attn = _attn(q, num_splits=1)
    tensors = [q, *kq.tensors(), *vq.tensors(), None, None]
    options = attn.run_options(k_format=k_format, v_format=k_format, decode_heads_per_tg=4)
    _, counters = sim.run_op("sdpa_quantized", tensors, options, counters=True, checkers=False)
    (c,) = counters
    buffers = {1: kq.data, 14: kq.scales, 15: kq.mins, 2: vq.data, 16: vq.scales, 17: vq.mins}
    # An int8 operand binds its scales in the mins' place; the kernel never reads them there.
    read = {i: c["buffers"][i]["read"] for i in buffers}
    want = {i: 0 if t is None else t.numel() * t.element_size() for i, t in buffers.items()}
    assert read == want
    kv_bytes = sum(read.values())
    assert kv_bytes == 2 * B * Hkv * S * E * per_value
    fp16_bytes = 2 * B * Hkv * S * E * 2
    assert kv_bytes / fp16_bytes == pytest.approx(per_value / 2)
