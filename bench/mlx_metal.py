"""MLX's steel GEMM, steel attention and sdpa_vector kernels (one and two pass) in the
simulator, bound as MLX's host code binds them.

The kernel headers come from the mlx-metal wheel (bench/corpora.MLX, fetched at test time);
tests/sim/kernels/mlx_*.metal include them unmodified and instantiate the templates the way
MLX's own .metal files do. The launches below restate what MLX's host code does
(mlx/backend/metal/matmul.cpp, scaled_dot_product_attention.cpp); none of its code is here.

- steel GEMM, `steel_gemm_fused_<ta><tb>_<in>_<out>_bm32_bn32_bk16_wm2_wn2` (the tile of the
  host's branch for batch * M * N < 2^20): an operand whose last stride is 1 is "n" with
  leading dimension its row stride, one whose row stride is 1 is "t" with leading dimension its
  last stride; grid (ceil(N / bn), ceil(M / bm), batch) with swizzle_log 0, threadgroup
  (32, wn, wm); buffers A, B, D at 0, 1, 3, GEMMParams at 4 (M, N, K, lda, ldb, ldd = N,
  tiles_n, tiles_m, int64 batch strides of A, B and D = M * N, swizzle_log,
  gemm_k_iterations_aligned = K / bk, batch_ndim), the batch shape at 6 and A's then B's batch
  strides (int64) at 7; function constants has_batch (10, batch_ndim > 1), use_out_source
  (100) and do_axpby (110) false for a plain product, align_M/N/K (200-202) whether bm, bn, bk
  divide M, N, K.
- steel attention, `steel_attention_<type>_bq32_bk<16 from head dim 128, else 32>_bd<D>_wm4_wn1
  _mask<mask type or the query's>`: grid (ceil(qL / 32), H, B), threadgroup (32, wm, wn);
  buffers Q, K, V, O, AttnParams at 4 (B, H, D, qL, kL, gqa factor, scale, NQ, NK, NQ_aligned,
  NK_aligned, qL_rem, kL_rem, qL_off = kL - qL, then the int64 B/H/L strides of Q, K, V, O),
  with a mask AttnMaskParams (its int64 B/H/qL strides) at 5 and the mask at 6; function
  constants align_Q (200), align_K (201), has_mask (300), do_causal (301), has_sinks (302).
  save_lse (303), which the header reads, is given false: no log-sum-exp buffer is bound.
- sdpa_vector, `sdpa_vector_<float|float16_t|bfloat16_t>_<D>_<V>` (the host takes it for
  query lengths up to 8): grid (B * H, qL, 1), 1024 threads; buffers Q, K, V, O, gqa factor
  (int) at 4, kL (int) at 5, K's head stride (its batch stride when it has one head) and
  sequence stride (size_t) at 6 and 7, V's at 8 and 9, scale (float) at 10; with a mask the
  mask at 11 (bool) or 12 (of the query's type), and its key, query and head strides (int, 0
  where the size is 1; the head stride the batch's when it has one head) at 13-15; function
  constants has_mask (20), query_transposed (21, false: Q is contiguous), do_causal (22),
  bool_mask (23), float_mask (24), has_sinks (25).
- two-pass sdpa_vector (the host's choice for long key counts: 1024 or more on chips whose
  architecture letter is 'd' or 's', 4096 or more with GQA on any chip; the tests bind it below
  those counts to keep the simulation short, and leave out the `_gqa` variant the host takes
  from 8192 keys at gqa factor 8). Read from the host at MLX's main of 2026-08 (0.32.2 dev); the
  header's buffers and function constants, from the 0.32.4 wheel, agree. Pass 1,
  `sdpa_vector_2pass_1_<type>_<D>_<V>`: `blocks` (function constant 26) threadgroups split the
  keys, block b taking keys b, b + blocks, ...; outside 'd' and 's' chips blocks is 64 when gqa
  factor * qL >= 4 and 32 otherwise (always a multiple of 32: pass 2 reduces whole simdgroups of
  blocks). Grid (Hkv, B, blocks), threadgroup (32, gqa factor, qL); buffers Q, K, V, the partial
  outputs ([B, H, qL, blocks, V] of Q's type), sums and maxs ([B, H, qL, blocks] float32) at
  0-5, kL (int) at 7, K's head and sequence strides at 8 and 9, V's at 10 and 11 (size_t, the
  head stride the batch's when there is one head), scale (float) at 12; a mask at 13 (bool) or
  14, its key, query and head strides at 15-17; the one-pass kernel's function constants 20-25.
  Pass 2, `sdpa_vector_2pass_2_<type>_<V>`: partials, sums, maxs, out at 0-3, blocks (int) at 4;
  grid (B * H, qL, 1), 1024 threads.
"""

from __future__ import annotations

import struct
from pathlib import Path

import corpora
import torch

from torch_steel import sim

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "tests" / "sim" / "kernels"

GEMM_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
VECTOR_NAMES = {torch.float32: "float", torch.float16: "float16_t", torch.bfloat16: "bfloat16_t"}
GEMM_TILE = (32, 32, 16, 2, 2)  # bm, bn, bk, wm, wn


def include_dir() -> Path:
    """The wheel's include directory (raises corpora.CorpusUnavailable offline)."""
    return corpora.include_dir(corpora.MLX)


def _layout(x: torch.Tensor) -> tuple[bool, int]:
    """(transposed, leading dimension) of a 2-D operand as MLX's host reads its strides."""
    rows, cols = x.stride(-2), x.stride(-1)
    if cols == 1:
        return False, rows
    if rows == 1:
        return True, cols
    raise ValueError("MLX copies an operand with neither stride 1 first; pass one that has")


def gemm_launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> dict:
    """out[z] = a[z] @ b[z] for [batch, M, K] x [batch, K, N] views (each matrix with a unit
    row or column stride, the batch dimension any stride) into a contiguous [batch, M, N]."""
    batch, M, K = a.shape
    N = b.shape[2]
    bm, bn, bk, wm, wn = GEMM_TILE
    ta, lda = _layout(a)
    tb, ldb = _layout(b)
    tn, tm = -(-N // bn), -(-M // bm)
    params = struct.pack(
        "<8i3q3i4x",
        *(M, N, K, lda, ldb, N, tn, tm),
        *(a.stride(0), b.stride(0), M * N),
        *(0, K // bk, 1),
    )
    name = (
        f"steel_gemm_fused_{'t' if ta else 'n'}{'t' if tb else 'n'}_{GEMM_NAMES[a.dtype]}_"
        f"{GEMM_NAMES[out.dtype]}_bm{bm}_bn{bn}_bk{bk}_wm{wm}_wn{wn}"
    )
    return {
        "name": name,
        "sources": [KERNELS / "mlx_steel_gemm.metal"],
        "include_dirs": [include_dir()],
        "grid": (tn, tm, batch),
        "threads": (32, wn, wm),
        "buffers": {
            0: a,
            1: b,
            3: out,
            4: params,
            6: struct.pack("<i", batch),
            7: struct.pack("<2q", a.stride(0), b.stride(0)),
        },
        "constants": {
            10: False,
            100: False,
            110: False,
            200: M % bm == 0,
            201: N % bn == 0,
            202: K % bk == 0,
        },
    }


def attention_launch(q, k, v, out, scale, causal=False, mask=None) -> dict:
    """Steel attention on [B, H, L, D] tensors (last stride 1); mask: None, bool (True keeps)
    or additive of q's dtype, [B, H, qL, kL] with unit last stride."""
    B, H, qL, D = q.shape
    kL = k.shape[2]
    bq, bk, wm, wn = 32, (16 if D >= 128 else 32), 4, 1
    NQ, NK = -(-qL // bq), -(-kL // bk)
    strides = [s for t in (q, k, v, out) for s in t.stride()[:3]]
    params = struct.pack(
        "<6if7i12q",
        *(B, H, D, qL, kL, H // k.shape[1]),
        scale,
        *(NQ, NK, qL // bq, kL // bk, qL - (qL // bq) * bq, kL - (kL // bk) * bk, kL - qL),
        *strides,
    )
    buffers = {0: q, 1: k, 2: v, 3: out, 4: params}
    mask_name = GEMM_NAMES[q.dtype]
    if mask is not None:
        buffers[5] = struct.pack("<3q", *mask.stride()[:3])
        buffers[6] = mask
        mask_name = "bool_" if mask.dtype == torch.bool else GEMM_NAMES[mask.dtype]
    return {
        "name": (
            f"steel_attention_{GEMM_NAMES[q.dtype]}_bq{bq}_bk{bk}_bd{D}_wm{wm}_wn{wn}"
            f"_mask{mask_name}"
        ),
        "sources": [KERNELS / "mlx_steel_attention.metal"],
        "include_dirs": [include_dir()],
        "grid": (NQ, H, B),
        "threads": (32, wm, wn),
        "buffers": buffers,
        "constants": {
            200: qL % bq == 0,
            201: kL % bk == 0,
            300: mask is not None,
            301: causal,
            302: False,
            303: False,
        },
    }


def vector_launch(q, k, v, out, scale, causal=False, mask=None) -> dict:
    """sdpa_vector on contiguous [B, H, qL, D] q and out and [B, Hkv, kL, D] k, v (last
    stride 1); mask: None, bool or additive of q's dtype, broadcastable to [B, H, qL, kL]."""
    B, H, qL, D = q.shape
    kL = k.shape[2]

    def head_stride(t):
        return t.stride(0) if t.shape[1] == 1 else t.stride(1)

    buffers = {
        0: q,
        1: k,
        2: v,
        3: out,
        4: struct.pack("<i", H // k.shape[1]),
        5: struct.pack("<i", kL),
        6: struct.pack("<Q", head_stride(k)),
        7: struct.pack("<Q", k.stride(2)),
        8: struct.pack("<Q", head_stride(v)),
        9: struct.pack("<Q", v.stride(2)),
        10: struct.pack("<f", scale),
    }
    is_bool = mask is not None and mask.dtype == torch.bool
    if mask is not None:
        sizes, st = mask.shape, mask.stride()
        buffers[12 - is_bool] = mask
        head = st[1] if sizes[1] > 1 else (st[0] if sizes[0] > 1 else 0)
        buffers[13] = struct.pack("<i", st[3] if sizes[3] > 1 else 0)
        buffers[14] = struct.pack("<i", st[2] if sizes[2] > 1 else 0)
        buffers[15] = struct.pack("<i", head)
    return {
        "name": f"sdpa_vector_{VECTOR_NAMES[q.dtype]}_{D}_{v.shape[-1]}",
        "sources": [KERNELS / "mlx_sdpa_vector.metal"],
        "include_dirs": [include_dir()],
        "grid": (B * H, qL, 1),
        "threads": (1024,),
        "buffers": buffers,
        "constants": {
            20: mask is not None,
            21: False,
            22: causal,
            23: is_bool,
            24: mask is not None and not is_bool,
            25: False,
        },
    }


def vector_2pass_launches(q, k, v, out, scale, causal=False, mask=None) -> list[dict]:
    """The two launches of two-pass sdpa_vector on the tensors of vector_launch; the
    intermediates (partials, sums, maxs) are allocated here, as MLX's host allocates them."""
    B, H, qL, _ = q.shape
    Hkv, V = k.shape[1], v.shape[-1]
    gqa = H // Hkv
    blocks = 64 if gqa * qL >= 4 else 32
    partials = torch.empty(B, H, qL, blocks, V, dtype=q.dtype)
    sums = torch.empty(B, H, qL, blocks, dtype=torch.float32)
    maxs = torch.empty(B, H, qL, blocks, dtype=torch.float32)
    one = vector_launch(q, k, v, out, scale, causal, mask)
    # The one-pass kernel's bindings from buffer 5 on move up by two (kL at 7: buffer 6 is
    # unused, the gqa factor comes from the threadgroup's height).
    buffers = {0: q, 1: k, 2: v, 3: partials, 4: sums, 5: maxs}
    buffers.update({i + 2: b for i, b in one["buffers"].items() if i >= 5})
    first = {
        **one,
        "name": f"sdpa_vector_2pass_1_{VECTOR_NAMES[q.dtype]}_{q.shape[-1]}_{V}",
        "sources": [KERNELS / "mlx_sdpa_vector_2pass.metal"],
        "grid": (Hkv, B, blocks),
        "threads": (32, gqa, qL),
        "buffers": buffers,
        "constants": {**one["constants"], 26: blocks},
    }
    second = {
        "name": f"sdpa_vector_2pass_2_{VECTOR_NAMES[q.dtype]}_{V}",
        "sources": [KERNELS / "mlx_sdpa_vector_2pass.metal"],
        "include_dirs": [include_dir()],
        "grid": (B * H, qL, 1),
        "threads": (1024,),
        "buffers": {0: partials, 1: sums, 2: maxs, 3: out, 4: struct.pack("<i", blocks)},
    }
    return [first, second]


def run(launch: dict, *, counters: bool = False, checkers: bool | None = None, **options):
    """sim.run_kernel on one launch; `options`: run_kernel's other keywords."""
    return sim.run_kernel(**launch, counters=counters, checkers=checkers, **options)
