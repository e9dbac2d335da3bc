"""The GEMM launch plan (mps_src/plan/gemm_plan.cpp) through torch_steel.sim.plan: tile choice,
alignment and vector-load flags, split-K, batch merging, copies, bindings and refusals."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest
import torch

from torch_steel import sim

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gemm"))
from gemm_helpers import requires_planner  # noqa: E402

pytestmark = requires_planner

# Function-constant and buffer indices (shaders/steel/params.h).
HAS_BATCH, USE_C, HAS_BIAS, ACTIVATION = 100, 110, 111, 112
ALIGN_M, ALIGN_N, ALIGN_K, VEC_A, VEC_B = 200, 201, 202, 210, 211
BUF_A, BUF_B, BUF_C, BUF_BIAS, BUF_OUT, BUF_PARAMS = 0, 1, 2, 3, 4, 5
PARAMS_SIZE = 140
PARAM_FIELDS = [
    "M",
    "N",
    "K",
    "lda",
    "ldb",
    "ldd",
    "tiles_m",
    "tiles_n",
    "swizzle_log",
    "k_split",
    "partial_stride",
    "partitions",
    "c_rs",
    "c_cs",
    "bias_stride",
]


def params(dispatch):
    raw = next(b.bytes for b in dispatch.bindings if b.index == BUF_PARAMS)
    assert len(raw) == PARAMS_SIZE
    ints = struct.unpack_from("15i", raw, 0)
    out = dict(zip(PARAM_FIELDS, ints, strict=True))
    out["alpha"], out["beta"] = struct.unpack_from("2f", raw, 60)
    out["batch_ndim"] = struct.unpack_from("i", raw, 68)[0]
    out["batch_shape"] = struct.unpack_from("4i", raw, 72)
    out["a_batch_strides"] = struct.unpack_from("4i", raw, 88)
    out["b_batch_strides"] = struct.unpack_from("4i", raw, 104)
    out["c_batch_strides"] = struct.unpack_from("4i", raw, 120)
    out["out_batch_stride"] = struct.unpack_from("i", raw, 136)[0]
    return out


def t(*shape, dtype=torch.float16, device="cpu"):
    return torch.empty(*shape, dtype=dtype, device=device)


def plan(a, b, bias=None, c=None, **options):
    p = sim.plan("gemm", [a, b, bias, c], options)
    assert p.ok, p.reason
    return p


def slots(dispatch):
    return {b.index: b.slot for b in dispatch.bindings if b.kind == "tensor"}


def test_small_square_uses_small_tile_aligned():
    (d,) = plan(t(128, 96), t(96, 64)).dispatches
    assert d.kernel == "steel_gemm_nn_f16_bm32_bn32_bk16_wm2_wn2"
    assert d.threads == (128, 1, 1)
    assert d.constants[ALIGN_M] and d.constants[ALIGN_N] and d.constants[ALIGN_K]
    assert d.constants[VEC_A] and d.constants[VEC_B]
    assert not d.constants[HAS_BATCH] and not d.constants[USE_C] and not d.constants[HAS_BIAS]
    p = params(d)
    assert (p["M"], p["N"], p["K"], p["lda"], p["ldb"], p["ldd"]) == (128, 64, 96, 96, 64, 64)
    assert (p["tiles_m"], p["tiles_n"]) == (4, 2)
    # The swizzled grid covers every tile: x = tiles_n << s, y = ceil(tiles_m / 2^s).
    s = p["swizzle_log"]
    assert d.grid == (2 << s, -(-4 // (1 << s)), 1)


@pytest.mark.parametrize(
    "dtype,tag", [(torch.float16, "f16"), (torch.bfloat16, "bf16"), (torch.float32, "f32")]
)
def test_large_problem_uses_large_tile(dtype, tag):
    (d,) = plan(t(1024, 1024, dtype=dtype), t(1024, 1024, dtype=dtype)).dispatches
    bk = 16 if dtype == torch.float32 else 32  # kLarge32: 4 f32 threadgroups a core
    assert d.kernel == f"steel_gemm_nn_{tag}_bm64_bn64_bk{bk}_wm2_wn4"
    assert d.threads == (256, 1, 1)
    p = params(d)
    assert (p["tiles_m"], p["tiles_n"], p["swizzle_log"]) == (16, 16, 2)
    assert d.grid == (16 << 2, 4, 1)


@pytest.mark.parametrize("max_threads,kernel,threads", [
    (1024, "bm64_bn64_bk32_wm2_wn4", 256),
    (256, "bm64_bn64_bk32_wm2_wn4", 256),
    (255, "bm64_bn64_bk16_wm2_wn2", 128),  # the same 64x64 block on 4 simdgroups
    (128, "bm64_bn64_bk16_wm2_wn2", 128),
])  # fmt: skip
def test_large_tile_follows_the_pipeline_thread_limit(max_threads, kernel, threads):
    meta = {"device": "meta"}
    (d,) = plan(t(1024, 1024, **meta), t(1024, 1024, **meta), max_threads=max_threads).dispatches
    assert d.kernel == f"steel_gemm_nn_f16_{kernel}" and d.threads == (threads, 1, 1)
    p = params(d)
    assert (p["tiles_m"], p["tiles_n"]) == (16, 16)


@pytest.mark.parametrize(
    "cores,tile",
    [
        (0, "bm32_bn32"),  # no core count described: below 128 blocks, 32x32
        (8, "bm64_bn64"),  # 64 blocks fill 8 waves of 8 cores
        (10, "bm64_bn64"),  # 64 of 70 slots (91%)
        (20, "bm32_bn32"),  # 64 of 80 slots (80%): cores idle in the last wave
        (40, "bm32_bn32"),
    ],
)
def test_small_grid_tile_by_core_waves(cores, tile):
    # 512^3: 64 blocks of 64x64. The rule and its timing-model figures are in gemm_plan.cpp.
    meta = {"device": "meta"}
    options = {"gpu_cores": cores} if cores else {}
    (d,) = plan(t(512, 512, **meta), t(512, 512, **meta), **options).dispatches
    assert f"_{tile}_" in d.kernel, d.kernel


def test_few_rows_past_the_gemv_use_small_tile():
    (d,) = plan(t(9, 4096), t(4096, 4096)).dispatches
    assert "_bm32_bn32_" in d.kernel
    assert not d.constants[ALIGN_M] and d.constants[ALIGN_N]


def test_few_rows_many_columns_uses_thin_tile():
    meta = {"device": "meta"}
    (d,) = plan(t(32, 4096, **meta), t(4096, 11008, **meta)).dispatches
    assert d.kernel == "steel_gemm_nn_f16_bm32_bn128_bk16_wm1_wn4"
    assert d.threads == (128, 1, 1)
    assert params(d)["tiles_n"] == 86


def test_many_rows_few_columns_uses_tall_tile():
    meta = {"device": "meta"}
    (d,) = plan(t(16384, 4096, **meta), t(4096, 16, **meta)).dispatches
    assert d.kernel == "steel_gemm_nn_f16_bm128_bn32_bk16_wm4_wn1"
    assert params(d)["tiles_m"] == 128


def test_alignment_flags_ragged():
    (d,) = plan(t(33, 17), t(17, 65)).dispatches
    assert (d.constants[ALIGN_M], d.constants[ALIGN_N], d.constants[ALIGN_K]) == (0, 0, 0)


@pytest.mark.parametrize(
    "ta,tb,name",
    [(False, False, "nn"), (False, True, "nt"), (True, False, "tn"), (True, True, "tt")],
)
def test_transposes_from_strides(ta, tb, name):
    a = t(40, 24).t() if ta else t(24, 40)  # [24, 40] either way
    b = t(56, 40).t() if tb else t(40, 56)
    p = plan(a, b)
    assert p.contiguous_inputs == []
    (d,) = p.dispatches
    assert d.kernel.startswith(f"steel_gemm_{name}_f16_")
    prm = params(d)
    assert prm["lda"] == (24 if ta else 40) and prm["ldb"] == (40 if tb else 56)


def test_operand_without_unit_stride_is_copied():
    a = t(30, 100)[:, ::2]
    b = t(50, 20)
    p = plan(a, b)
    assert p.contiguous_inputs == [0]
    assert p.dispatches[0].kernel.startswith("steel_gemm_nn_")
    assert params(p.dispatches[0])["lda"] == 50


def test_vector_loads_need_aligned_rows():
    base = t(64, 72)
    assert not plan(base[:, 1:65], t(64, 32)).dispatches[0].constants[VEC_A]  # odd offset
    assert not plan(t(64, 58)[:, :56], t(56, 32)).dispatches[0].constants[VEC_A]  # lda 58
    assert plan(base[:, 8:72], t(64, 32)).dispatches[0].constants[VEC_A]


def test_vector_load_alignment_is_the_access_size():
    # Metal needs an access of N bytes aligned to N bytes. The 32x32 tile's loaders move 4
    # elements per thread per access (32 * 16 / 128): 8 bytes in f16, so rows 8-byte aligned
    # (storage offset 4, or lda 60) are enough there; the 64x64 tile's move 8 (16 bytes).
    small = plan(t(64, 64)[:, 4:64], t(60, 32))
    d = small.dispatches[0]
    assert "_bm32_bn32_" in d.kernel and params(d)["lda"] == 64
    assert d.constants[VEC_A] and d.constants[VEC_B]
    assert plan(t(64, 60), t(60, 32)).dispatches[0].constants[VEC_A]  # lda 60: 120-byte rows
    assert not plan(t(64, 62)[:, :60], t(60, 32)).dispatches[0].constants[VEC_A]  # lda 62
    assert not plan(t(64, 64)[:, 2:62], t(60, 32)).dispatches[0].constants[VEC_A]  # offset 2
    assert not plan(t(64, 64), t(64, 34)[:, :32]).dispatches[0].constants[VEC_B]  # ldb 34
    assert plan(t(64, 64), t(64, 36)[:, :32]).dispatches[0].constants[VEC_B]  # ldb 36
    # f32 moves 4 elements = 16 bytes: lda 60 is fine, 62 is not.
    f32 = torch.float32
    assert plan(t(64, 60, dtype=f32), t(60, 32, dtype=f32)).dispatches[0].constants[VEC_A]
    d = plan(t(64, 62, dtype=f32)[:, :60], t(60, 32, dtype=f32)).dispatches[0]
    assert not d.constants[VEC_A]
    # The 64x64 tile in f16: 16-byte accesses, so lda 1028 (8-byte rows) is not enough.
    d = plan(t(1024, 1028)[:, :1024], t(1024, 1024)).dispatches[0]
    assert "_bm64_bn64_" in d.kernel
    assert not d.constants[VEC_A] and d.constants[VEC_B]
    d = plan(t(1024, 1032)[:, :1024], t(1024, 1024)).dispatches[0]
    assert d.constants[VEC_A]


def test_batch_dims_merge():
    p = plan(t(2, 3, 16, 8), t(2, 3, 8, 24))
    (d,) = p.dispatches
    prm = params(d)
    assert d.grid[2] == 6 and d.constants[HAS_BATCH]
    # [2, 3] with a and b contiguous merge into one dim of 6.
    assert prm["batch_ndim"] == 1 and prm["batch_shape"][0] == 6
    assert prm["a_batch_strides"][0] == 128 and prm["b_batch_strides"][0] == 192
    assert prm["out_batch_stride"] == 16 * 24
    assert p.allocations[0].sizes == (2, 3, 16, 24)


def test_batch_folds_into_m_when_b_is_shared():
    # x [2, 3, 16, 8] @ W [8, 24]: one [96, 8] @ [8, 24] GEMM, W read once per row block.
    p = plan(t(2, 3, 16, 8), t(8, 24))
    (d,) = p.dispatches
    prm = params(d)
    assert d.grid[2] == 1 and not d.constants[HAS_BATCH] and prm["batch_ndim"] == 0
    assert (prm["M"], prm["lda"], prm["tiles_m"]) == (96, 8, 3)
    assert p.allocations[0].sizes == (2, 3, 16, 24)
    # Decode: 8 sequences of one row each (row stride = the batch stride, 4096 + 64 here) are
    # one 8-row tile, not 8 mostly empty ones each reading all of W.
    x = t(8, 1, 4160)[:, :, :4096]
    d = plan(x, t(4096, 4096)).dispatches[0]
    assert (params(d)["M"], params(d)["lda"], d.grid[2]) == (8, 4160, 1)
    # c laid out row after row folds along (full c, or a row broadcast); c broadcast over the
    # batch does not, and neither does a batched b or a transposed a.
    assert params(plan(t(4, 5, 8), t(8, 24), c=t(4, 5, 24)).dispatches[0])["M"] == 20
    assert params(plan(t(4, 5, 8), t(8, 24), c=t(24)).dispatches[0])["c_rs"] == 0
    assert params(plan(t(4, 1, 8), t(8, 24), c=t(4, 1, 24)).dispatches[0])["c_rs"] == 24
    for a, b, c in [
        (t(4, 5, 8), t(8, 24), t(5, 24)),
        (t(4, 5, 8), t(4, 8, 24), None),
        (t(4, 8, 5).transpose(1, 2), t(8, 24), None),
        (t(4, 6, 8)[:, :5], t(8, 24), None),
    ]:
        d = plan(a, b, c=c).dispatches[0]
        assert params(d)["M"] == 5 and d.grid[2] == 4 and d.constants[HAS_BATCH]


def test_batch_broadcast_both_sides_not_merged():
    p = plan(t(2, 1, 16, 8), t(1, 3, 8, 24))
    prm = params(p.dispatches[0])
    assert prm["batch_ndim"] == 2 and prm["batch_shape"][:2] == (2, 3)
    assert prm["a_batch_strides"][:2] == (128, 0) and prm["b_batch_strides"][:2] == (0, 192)


def test_epilogue_constants_and_bindings():
    bias, c = t(24), t(16, 1)
    p = plan(t(16, 8), t(8, 24), bias, c, alpha=2.0, beta=0.5, activation="gelu_tanh")
    (d,) = p.dispatches
    assert d.constants[USE_C] and d.constants[HAS_BIAS] and d.constants[ACTIVATION] == 3
    prm = params(d)
    assert (prm["alpha"], prm["beta"], prm["c_rs"], prm["c_cs"]) == (2.0, 0.5, 1, 0)
    assert slots(d) == {BUF_A: 0, BUF_B: 1, BUF_C: 3, BUF_BIAS: 2, BUF_OUT: 4}


def test_beta_zero_drops_c():
    (d,) = plan(t(16, 8), t(8, 24), None, t(16, 24), beta=0.0).dispatches
    assert not d.constants[USE_C]
    assert slots(d)[BUF_C] == 0  # a stands in; never read


def test_split_k_small_output_long_k():
    p = plan(t(16, 4096), t(4096, 16), t(16), None, activation="relu")
    assert [d.kernel for d in p.dispatches] == [
        "steel_gemm_splitk_nn_f16_bm32_bn32_bk16_wm2_wn2",
        "steel_gemm_splitk_reduce_f16",
    ]
    first, reduce = p.dispatches
    prm = params(first)
    assert prm["partitions"] == first.grid[2] >= 2
    assert prm["k_split"] % 16 == 0 and prm["k_split"] * prm["partitions"] >= 4096
    assert (prm["partitions"] - 1) * prm["k_split"] < 4096
    scratch = p.allocations[1]
    assert scratch.dtype == torch.float32 and scratch.sizes == (prm["partitions"], 1, 16, 16)
    assert not scratch.is_output and p.allocations[0].is_output
    assert not first.constants[HAS_BIAS] and reduce.constants[HAS_BIAS]
    assert reduce.constants[ACTIVATION] == 1
    assert slots(first)[BUF_OUT] == slots(reduce)[BUF_A] == 5
    assert reduce.grid[0] * reduce.threads[0] >= 256


def test_split_k_of_a_batch():
    # 4 x [64, 4096] @ [4, 4096, 64]: 16 blocks of 32x32 over the batch, each walking K = 4096
    # unsplit; split, every entry's K is cut alike and the partials are [partitions, 4, 64, 64].
    p = plan(t(4, 64, 4096), t(4, 4096, 64), None, t(4, 1, 64), beta=1.0)
    first, reduce = p.dispatches
    assert first.kernel.startswith("steel_gemm_splitk_nn_f16")
    prm = params(first)
    assert prm["partitions"] >= 2 and first.grid[2] == 4 * prm["partitions"]
    assert prm["partial_stride"] == 4 * 64 * 64 and prm["out_batch_stride"] == 64 * 64
    assert p.allocations[1].sizes == (prm["partitions"], 4, 64, 64)
    assert first.constants[HAS_BATCH] and reduce.constants[HAS_BATCH]
    assert not first.constants[USE_C] and reduce.constants[USE_C]
    assert reduce.grid[0] * reduce.threads[0] >= 4 * 64 * 64


@pytest.mark.parametrize("cores,partitions", [(10, 16), (20, 20), (80, 32)])
def test_split_k_fills_the_cores(cores, partitions):
    # 4 one-block entries over K = 8192: about 64 threadgroups, or 4 a core on a bigger GPU
    # (at most 32 partitions).
    p = plan(t(4, 32, 8192), t(4, 8192, 32), gpu_cores=cores)
    assert params(p.dispatches[0])["partitions"] == partitions
    assert p.dispatches[0].grid[2] == 4 * partitions


@pytest.mark.parametrize(
    "shape", [((512, 512), (512, 512)), ((5, 64, 4096), (5, 4096, 64)), ((64, 300), (300, 64))]
)
def test_no_split_k(shape):
    p = plan(t(*shape[0]), t(*shape[1]))
    assert len(p.dispatches) == 1 and len(p.allocations) == 1


def test_empty_output_has_no_dispatch():
    p = plan(t(0, 8), t(8, 5))
    assert p.dispatches == [] and p.allocations[0].sizes == (0, 5)


@pytest.mark.parametrize(
    "tensors,options,match",
    [
        ([t(4, 4, dtype=torch.float64), t(4, 4, dtype=torch.float64)], {}, "float64"),
        ([t(4, 4, dtype=torch.int32), t(4, 4, dtype=torch.int32)], {}, "int32"),
        ([t(4, 4), t(4, 4, dtype=torch.float32)], {}, "dtype"),
        ([t(4), t(4, 4)], {}, "at least 2 dims"),
        ([t(4, 5), t(4, 4)], {}, "K"),
        ([t(2, 4, 4), t(3, 4, 4)], {}, "broadcast"),
        ([t(4, 4), t(4, 4), t(5)], {}, "bias"),
        ([t(4, 4), t(4, 4), None, t(3, 4)], {"beta": 1.0}, "broadcast"),
        ([t(4, 4), t(4, 4)], {"activation": "tanh"}, "activation"),
        # Five batch dims, each outer stride smaller than the inner: nothing merges.
        ([t(6, 5, 4, 3, 2, 4, 4).permute(4, 3, 2, 1, 0, 5, 6), t(4, 4)], {}, "batch dims"),
    ],
)
def test_refusals(tensors, options, match):
    p = sim.plan("gemm", tensors + [None] * (4 - len(tensors)), options)
    assert not p.ok
    assert match in p.reason


def test_refuses_beyond_32_bit_indexing():
    # A 2^16 x 2^16 output from expanded (stride-0) operands: 2^32 elements, no memory used.
    a = torch.empty(1, 1).expand(2**16, 1)
    b = torch.empty(1, 1).expand(1, 2**16)
    p = sim.plan("gemm", [a, b, None, None], {})
    assert not p.ok and "32-bit" in p.reason and "out" in p.reason


# ---- GEMV (gemm/gemv.h): M <= 8 or N <= 8 with both operands contiguous along K ----


def test_decode_linear_uses_gemv_rows():
    # x[1, K] @ W^T (W [N, K] row-major, as torch_steel.linear passes it): the timing model puts
    # the 32x32 tile at 2.3x the DRAM bound on M4 Pro (compute-bound on 1-in-32-real MMAs), the
    # GEMV at the bound (docs/gemm.md).
    meta = {"device": "meta"}
    (d,) = plan(t(1, 4096, **meta), t(4096, 4096, **meta).t()).dispatches
    assert d.kernel == "steel_gemv_rows_f16"
    assert d.grid == (256, 1, 1) and d.threads == (128, 1, 1)  # 4 simdgroups x 4 lines
    assert d.constants[VEC_A] and d.constants[VEC_B] and not d.constants[HAS_BATCH]
    assert ALIGN_M not in d.constants  # the GEMV has no tiles to align
    assert (params(d)["M"], params(d)["ldb"]) == (1, 4096)  # a single row has no row stride


def test_gemv_rows_up_to_eight_then_tiled():
    b = t(256, 512).t()
    assert plan(t(8, 512), b).dispatches[0].kernel == "steel_gemv_rows_f16"
    assert plan(t(9, 512), b).dispatches[0].kernel.startswith("steel_gemm_nt_")
    # A row-major b (lanes along K would read it across rows) takes the kernel along N.
    assert plan(t(8, 512), t(512, 256)).dispatches[0].kernel == "steel_gemv_nn_f16"
    assert plan(t(9, 512), t(512, 256)).dispatches[0].kernel.startswith("steel_gemm_nn_")
    # A transposed a keeps the tiled kernel.
    assert plan(t(512, 8).t(), b).dispatches[0].kernel.startswith("steel_gemm_tt_")


def test_decode_matmul_uses_gemv_nn():
    # x[1, K] @ W with W stored [K, N] (torch.matmul(x, W)): the tiled kernel is compute-bound at
    # 1.9x the DRAM bound on M4 Pro by the timing model; steel_gemv_nn_ reads W once, a strip of
    # 32 columns per threadgroup of 4 simdgroups.
    meta = {"device": "meta"}
    (d,) = plan(t(1, 4096, **meta), t(4096, 4096, **meta)).dispatches
    assert d.kernel == "steel_gemv_nn_f16"
    assert d.grid == (128, 1, 1) and d.threads == (128, 1, 1)
    assert d.constants[VEC_A] and d.constants[VEC_B] and not d.constants[HAS_BATCH]
    assert params(d)["ldb"] == 4096
    # Columns past a multiple of 32 get one more strip; W's row stride off 4 elements turns the
    # vector loads off.
    (d,) = plan(t(3, 64), t(64, 70)[:, :33]).dispatches
    assert d.kernel == "steel_gemv_nn_f16" and d.grid == (2, 1, 1)
    assert not d.constants[VEC_B] and params(d)["ldb"] == 70 and params(d)["M"] == 3


def test_few_columns_use_gemv_cols():
    (d,) = plan(t(1000, 300, dtype=torch.float32), t(5, 300, dtype=torch.float32).t()).dispatches
    assert d.kernel == "steel_gemv_cols_f32"
    assert d.grid == (63, 1, 1)  # 1000 lines of a, 16 a threadgroup


def test_single_column_b_is_a_gemv_line():
    # b [K, 1] with unit K stride is K-contiguous whatever its (unused) column stride says.
    (d,) = plan(t(3, 64), t(64, 1)).dispatches
    assert d.kernel == "steel_gemv_rows_f16"


def test_gemv_batches_fold_or_offset():
    # b shared, a's entries row after row: folded into M = 6, no batch offsets.
    (d,) = plan(t(2, 3, 64), t(32, 64).t()).dispatches
    assert d.kernel == "steel_gemv_rows_f16" and d.grid[2] == 1 and params(d)["M"] == 6
    # b batched: one z per entry, batch offsets on.
    (d,) = plan(t(4, 2, 64), t(4, 32, 64).transpose(-1, -2)).dispatches
    assert d.kernel == "steel_gemv_rows_f16" and d.grid[2] == 4 and d.constants[HAS_BATCH]
    assert params(d)["b_batch_strides"][0] == 32 * 64


def test_gemv_yields_to_split_k():
    # 16 output columns are one threadgroup of GEMV walking K = 4096; split-K runs 32 slices.
    p = plan(t(1, 4096), t(16, 4096).t())
    assert [d.kernel.split("_bm")[0] for d in p.dispatches] == [
        "steel_gemm_splitk_nt_f16",
        "steel_gemm_splitk_reduce_f16",
    ]


def test_gemv_vector_loads_need_aligned_lines():
    w = t(40, 68)
    (d,) = plan(t(2, 68)[:, 1:65], w[:, :64].t()).dispatches
    assert d.kernel == "steel_gemv_rows_f16"
    assert not d.constants[VEC_A] and d.constants[VEC_B]
    (d,) = plan(t(2, 64), t(40, 66)[:, 2:].t()).dispatches  # ld 66: line starts off by 2
    assert d.constants[VEC_A] and not d.constants[VEC_B]
