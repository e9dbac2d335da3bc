"""llama.cpp's Metal flash attention in the simulator, bound as ggml's Metal host binds it.

The kernels come from the llama-cpp-python source distribution (bench/corpora.LLAMA, fetched at
test time): ggml/src/ggml-metal/kernels/fa_f16.metal (kernel_flash_attn_ext_f16_dk<D>_dv<D>,
its own instantiations) and fa_aux.metal (kernel_flash_attn_ext_pad), compiled unmodified. What
follows restates ggml-metal-ops.cpp (ggml_metal_op_flash_attn_ext, the "half8x8" path that
takes more than a few queries) and ggml-metal-impl.h; none of its code is here.

ggml's shapes are innermost first: Q [DK, n_q, H, B] float32, K [DK, n_kv, H_kv, B] and V
[DV, n_kv, H_kv, B] float16, the result [DV, H, n_q, B] float32 (heads inside queries); nb are
byte strides. Here they are the contiguous torch tensors q [B, H, n_q, DK], k and v
[B, H_kv, n_kv, D] and out [B, n_q, H, DV].

- When n_kv is not a multiple of the 64 keys a simdgroup takes per step (ncpsg), the pad kernel
  first copies the last partial block of K and V into a scratch buffer (zeros past n_kv):
  grid (ncpsg, H_kv, B) of 32 threads; args (ne11, ne12, ne13, nb11-13, nb21-23, the mask's
  ne31-33 and nb31-33, 0 without one) at 0, K, V, the mask at 1-3, the scratch at 4; function
  constants has_mask (FC_FLASH_ATTN_EXT_PAD + 0 = 100) and ncpsg (+ 25 = 125). The scratch
  holds ncpsg rows of K then of V per KV head (ggml_metal_op_flash_attn_ext_extra_pad).
- The attention kernel: 8 queries per threadgroup (nqptg), grid (ceil(n_q / 8), H, B),
  threadgroup (32, nsg, 1) with nsg 4 (8 from head dim 512); args
  (ggml_metal_kargs_flash_attn_ext: ne01-03 and nb01-03 of Q, ne11, ne12, ne13, ns10 = K's row
  stride in elements, nb11-13, ns20, nb21-23, the mask's ne31-33 and nb31-33, the result's
  ne1-3, scale, max_bias, m0, m1, n_head_log2, logit_softcap) at 0, then Q, K, V, mask, sinks,
  the pad scratch, the mask's block map and the result at 1-8 (the kernel names no indices:
  Metal assigns them in order); threadgroup memory 0 of 2 * nqptg * (DK + 2 * pad64(DV) +
  4 * ncpsg) bytes rounded up to 16; function constants at FC_FLASH_ATTN_EXT = 300: has_mask
  (+0), has_sinks (+1), has_bias (+2), has_scap (+3), has_kvpad (+4), bc_mask (+10), ns10 (+20),
  ns20 (+21), nsg (+22).
"""

from __future__ import annotations

import struct
from pathlib import Path

import corpora
import torch

from torch_steel import sim

NQPTG = 8  # queries per threadgroup (OP_FLASH_ATTN_EXT_NQPSG)
NCPSG = 64  # keys per simdgroup step (OP_FLASH_ATTN_EXT_NCPSG)
FC_PAD = 100  # FC_FLASH_ATTN_EXT_PAD
FC_BLK = 200  # FC_FLASH_ATTN_EXT_BLK
FC = 300  # FC_FLASH_ATTN_EXT


def source_dir() -> Path:
    """ggml/ of the source distribution (raises corpora.CorpusUnavailable offline)."""
    return corpora.include_dir(corpora.LLAMA)


def _paths():
    root = source_dir()
    kernels = root / "src" / "ggml-metal" / "kernels"
    return kernels, [root / "src" / "ggml-metal", root / "src"]


def flash_attn_launches(q, k, v, out, scale, mask=None) -> list[dict]:
    """The launches for out = softmax(scale * q k^T + mask) v (q float32, k and v float16,
    contiguous; mask None or float16 [B or 1, 1, n_q, n_kv], additive; see the module
    docstring): the pad kernel when n_kv % 64 != 0, the block map with a mask, then the
    attention kernel."""
    B, H, n_q, DK = q.shape
    Hkv, n_kv, DV = k.shape[1], k.shape[2], v.shape[3]
    kernels, includes = _paths()
    nb1 = (k.element_size() * DK, k.stride(1) * 2, k.stride(0) * 2)
    nb2 = (v.element_size() * DV, v.stride(1) * 2, v.stride(0) * 2)
    if mask is None:
        ne3, nb3 = (0, 0, 0), (0, 0, 0)
    else:
        ne3 = (mask.shape[2], mask.shape[1], mask.shape[0])  # ne31 rows, ne32 heads, ne33
        nb3 = tuple(2 * s for s in (mask.stride(2), mask.stride(1), mask.stride(0)))
    has_kvpad = n_kv % NCPSG != 0
    # Scratch of the pad kernel: ncpsg rows of K, of V (per KV head) and of the mask; Metal
    # buffers start uninitialized (all-one bytes here).
    pad_bytes = NCPSG * ((nb1[0] + nb2[0]) * Hkv * B + 2 * ne3[0] * ne3[1] * ne3[2])
    pad = torch.full((pad_bytes,), 0xFF, dtype=torch.uint8)
    launches = []
    if has_kvpad:
        args = struct.pack("<3i4x6Q3i4x3Q", n_kv, Hkv, B, *nb1, *nb2, *ne3, *nb3)
        buffers = {0: args, 1: k, 2: v, 4: pad}
        if mask is not None:
            buffers[3] = mask
        launches.append(
            {
                "name": "kernel_flash_attn_ext_pad",
                "sources": [kernels / "fa_aux.metal"],
                "include_dirs": includes,
                "grid": (NCPSG, max(Hkv, ne3[1]), max(B, ne3[2])),
                "threads": (32,),
                "buffers": buffers,
                "constants": {FC_PAD: mask is not None, FC_PAD + 25: NCPSG},
            }
        )
    nblk1, nblk0 = -(-n_q // NQPTG), -(-n_kv // NCPSG)
    blk = torch.full((nblk0 * nblk1 * max(1, ne3[1] * ne3[2]),), -1, dtype=torch.int8)
    if mask is not None:
        args = struct.pack("<5i4x3Q", n_q, n_kv, *ne3, *nb3)
        launches.append(
            {
                "name": "kernel_flash_attn_ext_blk",
                "sources": [kernels / "fa_aux.metal"],
                "include_dirs": includes,
                "grid": (nblk0, nblk1, ne3[1] * ne3[2]),
                "threads": (32,),
                "buffers": {0: args, 1: mask, 2: blk},
                "constants": {FC_BLK + 24: NQPTG, FC_BLK + 25: NCPSG},
            }
        )
    nsg = 8 if DK >= 512 else 4
    dv_pad = -(-DV // 64) * 64
    smem = -(-(2 * NQPTG * (DK + 2 * dv_pad + 4 * NCPSG)) // 16) * 16
    nb0 = (q.element_size() * DK, q.stride(1) * 4, q.stride(0) * 4)
    args = struct.pack(
        "<3i4x3Q4i3Qi4x3Q3i4x3Q3i4fif4x",
        *(n_q, H, B),
        *nb0,
        *(n_kv, Hkv, B, DK),
        *nb1,
        DV,
        *nb2,
        *ne3,
        *nb3,
        *(H, n_q, B),
        *(scale, 0.0, 1.0, 1.0),
        0,
        0.0,
    )
    buffers = {0: args, 1: q, 2: k, 3: v, 6: pad, 8: out}
    if mask is not None:
        buffers.update({4: mask, 7: blk})
    launches.append(
        {
            "name": f"kernel_flash_attn_ext_f16_dk{DK}_dv{DV}",
            "sources": [kernels / "fa_f16.metal"],
            "include_dirs": includes,
            "grid": (nblk1, H, B),
            "threads": (32, nsg, 1),
            "buffers": buffers,
            "threadgroup_memory": {0: smem},
            "constants": {
                FC + 0: mask is not None,
                FC + 1: False,
                FC + 2: False,
                FC + 3: False,
                FC + 4: has_kvpad,
                FC + 10: mask is not None and ne3[0] % 8 != 0,
                FC + 20: DK,
                FC + 21: DV,
                FC + 22: nsg,
            },
        }
    )
    return launches


def run(launch: dict, *, counters: bool = False, checkers: bool | None = None, **options):
    """sim.run_kernel on one launch; `options`: run_kernel's other keywords."""
    return sim.run_kernel(**launch, counters=counters, checkers=checkers, **options)
