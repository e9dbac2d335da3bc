"""llama.cpp's Metal flash attention in the simulator, bound as ggml's Metal host binds it.

The kernels come from the llama-cpp-python source distribution (bench/corpora.LLAMA, fetched at
test time), ggml/src/ggml-metal/kernels/, compiled unmodified: fa_f16.metal and fa_<type>.metal
(kernel_flash_attn_ext_<type>_dk<D>_dv<D>, the "half8x8" kernel), fa_vec_f16.metal and
fa_vec_<type>.metal (kernel_flash_attn_ext_vec_<type>_dk<D>_dv<D>[_q<Q>_ne<NE>], the vector
kernel), and fa_aux.metal (the pad, mask-block, dequantize-to-f16 and vector-reduce kernels),
each with its own instantiations. What follows restates ggml-metal-ops.cpp
(ggml_metal_op_flash_attn_ext and the extra_* scratch sizes), ggml-metal-device.cpp (the
pipelines' function constants), ggml-metal-tuning.cpp (the vector kernel's baseline NE) and
ggml-metal-impl.h (the argument structs); none of their code is here.

ggml's shapes are innermost first: Q [DK, n_q, H, B] float32, K [DK, n_kv, H_kv, B] and V
[DV, n_kv, H_kv, B] (f16 or quantized blocks), the result [DV, H, n_q, B] float32 (heads inside
queries); nb are byte strides. Here q is a torch tensor [B, H, n_q, DK]; k and v are
[B, H_kv, n_kv, row] views of any strides (float16 rows of D values, or uint8 rows of
D / 32 blocks for a quantized type, see KV_TYPES), as llama.cpp's KV cache views are; the
result is [B, n_q, H, DV]. K and V are bound at their view's offset with the rest of their
storage after it, as ggml binds a view of the cache's buffer.

Which kernel runs (ggml_metal_op_flash_attn_ext; `launches` makes this choice):
- n_q < 20 and DK % 32 == 0: the vector kernel, 32 workgroups (nwg) over the keys, then the
  reduce kernel. Keys per simdgroup step (ncpsg) 32; when n_kv % 32 != 0 the pad kernel first
  copies the last partial block of K and V (and the mask) to a scratch buffer. Grid
  (ceil(n_q / Q), H, B * nwg), threadgroup (32, nsg, 1), nsg the smallest of 1, 2, 4 with
  2 * nwg * nsg * 32 >= n_kv (else 4); Q queries a threadgroup and NE head elements a thread:
  the baseline (Q 1, fa_vec_baseline_ne) for short caches (n_kv < 1024) and for untuned GPU
  families, a tuned (Q, NE) from ggml-metal-tuning.cpp's table otherwise. Args
  ggml_metal_kargs_flash_attn_ext_vec at 0, Q, K, V, mask, sinks at 1-5, the pad scratch at
  6, the per-workgroup partials at 7, the sparse index list at 8 (Q bound in place of each
  absent tensor, as the host does); threadgroup memory 0 of
  2 * Q * nsg * (pad128(DK) + 4 * 32 + 2 * pad128(DV)) bytes rounded up to 16; function
  constants at FC_FLASH_ATTN_EXT_VEC = 400: has_mask (+0), has_sinks (+1), has_bias (+2),
  has_scap (+3), has_kvpad (+4), has_sparse (+5), ns10 (+20), ns20 (+21), nsg (+22),
  nwg (+23). The partials are [rows][DV / 4][nwg] float4 then [rows][nwg] (S, M) pairs,
  rows = B * n_q * H; the reduce kernel (args: rows; partials at 1, result at 2; constants
  DV at 500, nwg at 501) runs one threadgroup of 32 * nwg threads a row.
- otherwise the half8x8 kernel: 8 queries per threadgroup (nqptg), 64 keys a step; pad
  kernel when n_kv % 64 != 0, the mask-block kernel with a mask; grid (ceil(n_q / 8), H, B),
  threadgroup (32, nsg, 1) with nsg 4 (8 from DK 512); args ggml_metal_kargs_flash_attn_ext
  at 0, then Q, K, V, mask, sinks, the pad scratch, the block map and the result at 1-8;
  threadgroup memory 0 of 2 * (8 * (DK + 2 * pad64(DV) + 4 * 64) + 16 * 32 * nsg for
  quantized K/V) bytes rounded up to 16; function constants at FC_FLASH_ATTN_EXT = 300:
  has_mask (+0), has_sinks (+1), has_bias (+2), has_scap (+3), has_kvpad (+4), bc_mask (+10),
  ns10 (+20), ns20 (+21), nsg (+22).
- quantized K/V with n_q >= 32 (use_kv_f16): kernel_flash_attn_ext_kv_<type>_f16 first
  dequantizes K and then V into contiguous float16 scratch (one thread a block, threadgroups
  of 256), and the f16 half8x8 kernel reads that.
- The pad kernel: grid (ncpsg, max(H_kv, mask heads), max(B, mask batches)) of 32 threads;
  args (ne11, ne12, ne13, nb11-13, nb21-23, the mask's ne31-33 and nb31-33, 0 without one) at
  0, K, V, the mask at 1-3, the scratch at 4; constants has_mask (100) and ncpsg (125). The
  scratch is reserved for 64 rows of K, of V and of the mask per head whichever kernel runs
  (ggml_metal_op_flash_attn_ext_extra_pad); the kernel lays out ncpsg rows of each.
"""

from __future__ import annotations

import struct
from pathlib import Path

import corpora
import torch

from torch_steel import sim

NQPTG = 8  # queries per threadgroup (OP_FLASH_ATTN_EXT_NQPSG)
NCPSG = 64  # keys per simdgroup step (OP_FLASH_ATTN_EXT_NCPSG)
VEC_NCPSG = 32  # the vector kernel's keys per step (OP_FLASH_ATTN_EXT_VEC_NCPSG)
VEC_NWG = 32  # the vector kernel's workgroups over the keys (fixed in the host)
FC_PAD = 100  # FC_FLASH_ATTN_EXT_PAD
FC_BLK = 200  # FC_FLASH_ATTN_EXT_BLK
FC = 300  # FC_FLASH_ATTN_EXT
FC_VEC = 400  # FC_FLASH_ATTN_EXT_VEC
FC_VEC_REDUCE = 500  # FC_FLASH_ATTN_EXT_VEC_REDUCE

# ggml's K/V types: (values per block, bytes per block), from ggml-common.h's block structs.
KV_TYPES = {
    "f16": (1, 2),
    "q4_0": (32, 18),  # half d, 16 bytes of nibbles
    "q4_1": (32, 20),  # half d, half m, 16 bytes of nibbles
    "q5_0": (32, 22),  # half d, 4 bytes of fifth bits, 16 bytes of nibbles
    "q5_1": (32, 24),  # half d, half m, 4 bytes of fifth bits, 16 bytes of nibbles
    "q8_0": (32, 34),  # half d, 32 int8 codes
}

# ggml-metal-tuning.cpp's fa_vec_baseline_ne: head elements a thread of the vector kernel
# takes, per (DK, DV), in the baseline instantiation (the kernel's name has no _q<Q>_ne<NE>).
_VEC_BASELINE_NE = {(64, 64): 2, (128, 128): 1, (192, 192): 2, (192, 128): 2, (256, 256): 1}
_VEC_BASELINE_NE.update({(320, 256): 2, (512, 512): 1, (576, 512): 2})


def source_dir() -> Path:
    """ggml/ of the source distribution (raises corpora.CorpusUnavailable offline)."""
    return corpora.include_dir(corpora.LLAMA)


def _paths():
    root = source_dir()
    kernels = root / "src" / "ggml-metal" / "kernels"
    return kernels, [root / "src" / "ggml-metal", root / "src"]


def _pad(n: int, m: int) -> int:
    return -(-n // m) * m


def _bound(t: torch.Tensor) -> torch.Tensor:
    """The buffer the host binds for a view: from the view's first byte to its storage's end
    (a view of llama.cpp's KV cache is bound at its offset in the cache's buffer)."""
    flat = torch.empty(0, dtype=t.dtype)
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return flat.set_(t.untyped_storage(), t.storage_offset(), (n,))


def _nb(t: torch.Tensor) -> tuple[int, int, int]:
    """ggml's nb1-3 of a [B, heads, rows, row] view: the rows', heads' and batches' strides."""
    e = t.element_size()
    return t.stride(2) * e, t.stride(1) * e, t.stride(0) * e


def _mask_layout(mask):
    if mask is None:  # GGML_TENSOR_LOCALS of a null tensor: zeros
        return (0, 0, 0), (0, 0, 0)
    ne3 = (mask.shape[2], mask.shape[1], mask.shape[0])  # ne31 rows, ne32 heads, ne33
    return ne3, _nb(mask)


def _block(kv_type: str) -> tuple[int, int]:
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type {kv_type!r}: expected one of {sorted(KV_TYPES)}")
    return KV_TYPES[kv_type]


def _pad_scratch(k, v, mask):
    """ggml_metal_op_flash_attn_ext_extra_pad: 64 rows of K, of V and of the mask per head
    (reserved whether or not the pad kernel runs); Metal buffers start uninitialized (all-one
    bytes here)."""
    Hkv, B = k.shape[1], k.shape[0]
    ne3, _ = _mask_layout(mask)
    nbytes = NCPSG * ((_nb(k)[0] + _nb(v)[0]) * Hkv * B + 2 * ne3[0] * ne3[1] * ne3[2])
    return torch.full((nbytes,), 0xFF, dtype=torch.uint8)


def _pad_launch(q, k, v, mask, pad, ncpsg):
    Hkv, n_kv, B = k.shape[1], k.shape[2], k.shape[0]
    kernels, includes = _paths()
    ne3, nb3 = _mask_layout(mask)
    args = struct.pack("<3i4x6Q3i4x3Q", n_kv, Hkv, B, *_nb(k), *_nb(v), *ne3, *nb3)
    return {
        "name": "kernel_flash_attn_ext_pad",
        "sources": [kernels / "fa_aux.metal"],
        "include_dirs": includes,
        "grid": (ncpsg, max(Hkv, ne3[1]), max(B, ne3[2])),
        "threads": (32,),
        "buffers": {0: args, 1: _bound(k), 2: _bound(v), 3: q if mask is None else mask, 4: pad},
        "constants": {FC_PAD: mask is not None, FC_PAD + 25: ncpsg},
    }


def _attn_args(q, k, v, out, scale, mask, kv_type, n_kv_rows=None):
    """ggml_metal_kargs_flash_attn_ext (the vector kernel's struct appends n_kv_max_padded)."""
    B, H, n_q, DK = q.shape
    Hkv, n_kv = k.shape[1], k.shape[2]
    ne3, nb3 = _mask_layout(mask)
    nb0 = _nb(q)
    nb1, nb2 = _nb(k), _nb(v)
    block_bytes = _block(kv_type)[1]
    ns10, ns20 = nb1[0] // block_bytes, nb2[0] // block_bytes  # nb11 / nb10, nb21 / nb20
    head = struct.pack(
        "<3i4x3Q4i3Qi4x3Q3i4x3Q3i4fif",
        *(n_q, H, B),
        *nb0,
        *(n_kv, Hkv, B, ns10),
        *nb1,
        ns20,
        *nb2,
        *ne3,
        *nb3,
        *(H, n_q, B),
        *(scale, 0.0, 1.0, 1.0),
        0,
        0.0,
    )
    return head, ns10, ns20


def flash_attn_launches(q, k, v, out, scale, mask=None, kv_type="f16") -> list[dict]:
    """The half8x8 kernel's launches for out = softmax(scale * q k^T + mask) v (q float32;
    k, v of kv_type; mask None or float16 [B or 1, 1, n_q, n_kv], additive; see the module
    docstring): the pad kernel when n_kv % 64 != 0, the block map with a mask, then the
    attention kernel."""
    B, H, n_q, DK = q.shape
    n_kv, DV = k.shape[2], out.shape[3]
    kernels, includes = _paths()
    ne3, nb3 = _mask_layout(mask)
    has_kvpad = n_kv % NCPSG != 0
    pad = _pad_scratch(k, v, mask)
    launches = []
    if has_kvpad:
        launches.append(_pad_launch(q, k, v, mask, pad, NCPSG))
    nblk1, nblk0 = -(-n_q // NQPTG), -(-n_kv // NCPSG)
    # ggml_metal_op_flash_attn_ext_extra_blk (none without a mask: the region after the pad
    # scratch is bound all the same)
    blk = torch.full((_pad(nblk0 * nblk1 * max(1, ne3[1] * ne3[2]), 32),), -1, dtype=torch.int8)
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
    is_q = kv_type != "f16"
    smem = _pad(2 * (NQPTG * (DK + 2 * _pad(DV, 64) + 4 * NCPSG) + is_q * 16 * 32 * nsg), 16)
    args, ns10, ns20 = _attn_args(q, k, v, out, scale, mask, kv_type)
    args += b"\0" * 4  # the struct's tail padding to 8 bytes
    buffers = {0: args, 1: q, 2: _bound(k), 3: _bound(v), 4: q, 5: q, 6: pad, 7: blk, 8: out}
    if mask is not None:
        buffers[4] = mask
    launches.append(
        {
            "name": f"kernel_flash_attn_ext_{kv_type}_dk{DK}_dv{DV}",
            "sources": [kernels / f"fa_{kv_type}.metal"],
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
                FC + 20: ns10,
                FC + 21: ns20,
                FC + 22: nsg,
            },
        }
    )
    return launches


def vec_baseline_ne(DK: int, DV: int) -> int:
    """fa_vec_baseline_ne (4, the template's default, for pairs not listed)."""
    return _VEC_BASELINE_NE.get((DK, DV), 4)


def flash_attn_vec_launches(
    q, k, v, out, scale, mask=None, kv_type="f16", nqptg=1, ne=None
) -> list[dict]:
    """The vector kernel's launches (see the module docstring): the pad kernel when
    n_kv % 32 != 0, the attention kernel over 32 workgroups, the reduce kernel. nqptg, ne:
    the (Q, NE) configuration, by default the baseline the host takes for short caches."""
    B, H, n_q, DK = q.shape
    n_kv, DV = k.shape[2], out.shape[3]
    ne = vec_baseline_ne(DK, DV) if ne is None else ne
    kernels, includes = _paths()
    has_kvpad = n_kv % VEC_NCPSG != 0
    pad = _pad_scratch(k, v, mask)
    launches = []
    if has_kvpad:
        launches.append(_pad_launch(q, k, v, mask, pad, VEC_NCPSG))
    nwg, nsg = VEC_NWG, 1
    while 2 * nwg * nsg * VEC_NCPSG < n_kv and nsg < 4:
        nsg *= 2
    smem = _pad(2 * (_pad(DK, 128) + 4 * VEC_NCPSG + 2 * _pad(DV, 128)) * nqptg * nsg, 16)
    args, ns10, ns20 = _attn_args(q, k, v, out, scale, mask, kv_type)
    args += struct.pack("<i", 0)  # n_kv_max_padded: no sparse index lists
    rows = B * n_q * H
    # ggml_metal_op_flash_attn_ext_extra_tmp: the partials of each workgroup, then (S, M)
    tmp = torch.full((rows * nwg * (DV + 2),), float("nan"))
    suffix = "" if (nqptg, ne) == (1, vec_baseline_ne(DK, DV)) else f"_q{nqptg}_ne{ne}"
    buffers = {0: args, 1: q, 2: _bound(k), 3: _bound(v), 4: q, 5: q, 6: pad, 7: tmp, 8: q}
    if mask is not None:
        buffers[4] = mask
    launches.append(
        {
            "name": f"kernel_flash_attn_ext_vec_{kv_type}_dk{DK}_dv{DV}{suffix}",
            "sources": [kernels / f"fa_vec_{kv_type}.metal"],
            "include_dirs": includes,
            "grid": (-(-n_q // nqptg), H, B * nwg),
            "threads": (32, nsg, 1),
            "buffers": buffers,
            "threadgroup_memory": {0: smem},
            "constants": {
                FC_VEC + 0: mask is not None,
                FC_VEC + 1: False,
                FC_VEC + 2: False,
                FC_VEC + 3: False,
                FC_VEC + 4: has_kvpad,
                FC_VEC + 5: False,
                FC_VEC + 20: ns10,
                FC_VEC + 21: ns20,
                FC_VEC + 22: nsg,
                FC_VEC + 23: nwg,
            },
        }
    )
    launches.append(
        {
            "name": "kernel_flash_attn_ext_vec_reduce",
            "sources": [kernels / "fa_aux.metal"],
            "include_dirs": includes,
            "grid": (rows,),
            "threads": (32 * nwg,),
            "buffers": {0: struct.pack("<i", rows), 1: tmp, 2: out},
            "constants": {FC_VEC_REDUCE + 0: DV, FC_VEC_REDUCE + 1: nwg},
        }
    )
    return launches


def kv_f16_launch(x, kv_type, dst) -> dict:
    """kernel_flash_attn_ext_kv_<type>_f16: the quantized [B, heads, rows, row bytes] view x
    dequantized into dst, contiguous float16 [B, heads, rows, D]."""
    kernels, includes = _paths()
    per_block, block_bytes = _block(kv_type)
    D = dst.shape[3]
    nblocks = (D // per_block) * x.shape[2] * x.shape[1] * x.shape[0]
    args = struct.pack(
        "<4i4Qi4x", D, x.shape[2], x.shape[1], x.shape[0], block_bytes, *_nb(x), nblocks
    )
    nth = 256  # min(the pipeline's maximum threads, 256)
    return {
        "name": f"kernel_flash_attn_ext_kv_{kv_type}_f16",
        "sources": [kernels / "fa_aux.metal"],
        "include_dirs": includes,
        "grid": (-(-nblocks // nth),),
        "threads": (nth,),
        "buffers": {0: args, 1: _bound(x), 2: dst},
    }


def kernel_path(n_q: int, DK: int, kv_type: str) -> str:
    """ggml_metal_op_flash_attn_ext's choice: "vec", "kv_f16" (dequantize, then the f16
    half8x8 kernel) or "half8x8"."""
    if n_q < 20 and DK % 32 == 0:
        return "vec"
    if kv_type != "f16" and n_q >= 32:
        return "kv_f16"
    return "half8x8"


def launches(q, k, v, out, scale, mask=None, kv_type="f16") -> list[dict]:
    """Every launch ggml's Metal host makes for this flash attention (see kernel_path)."""
    path = kernel_path(q.shape[2], q.shape[3], kv_type)
    if path == "vec":
        return flash_attn_vec_launches(q, k, v, out, scale, mask, kv_type)
    if path == "half8x8":
        return flash_attn_launches(q, k, v, out, scale, mask, kv_type)
    DK, DV = q.shape[3], out.shape[3]
    k16 = torch.full((*k.shape[:3], DK), float("nan"), dtype=torch.float16)
    v16 = torch.full((*v.shape[:3], DV), float("nan"), dtype=torch.float16)
    return [
        kv_f16_launch(k, kv_type, k16),
        kv_f16_launch(v, kv_type, v16),
        *flash_attn_launches(q, k16, v16, out, scale, mask, "f16"),
    ]


def quantize(x: torch.Tensor, kv_type: str) -> torch.Tensor:
    """x [..., D] (D a multiple of 32) as ggml's blocks of kv_type, uint8 [..., D / 32 * bytes]:
    scales as ggml's reference quantizers choose them (q8_0: d = max|x| / 127; q4_0 and q5_0:
    d = the value of largest magnitude / -8 or -16; q4_1 and q5_1: d = (max - min) / 15 or 31,
    m = min). The tests read the codes back with `dequantize`, so the choice only sets the
    error, never the check."""
    if kv_type == "f16" or kv_type not in KV_TYPES:
        raise ValueError(f"quantize: kv_type {kv_type!r} is not a quantized type")
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    if kv_type == "q8_0":
        d = (xb.abs().amax(-1) / 127).half()
        q = torch.round(xb / _safe(d)).clamp(-127, 127).to(torch.int8)
        return torch.cat([_bytes(d), q.view(torch.uint8)], -1).flatten(-2)
    bits = 4 if kv_type.startswith("q4") else 5
    levels = (1 << bits) - 1
    if kv_type.endswith("_0"):
        big = xb.gather(-1, xb.abs().argmax(-1, keepdim=True)).squeeze(-1)
        d = (big / -(1 << (bits - 1))).half()
        codes = torch.floor(xb / _safe(d) + (1 << (bits - 1)) + 0.5).clamp(0, levels)
        head = [_bytes(d)]
    else:
        lo, hi = xb.amin(-1), xb.amax(-1)
        d, m = ((hi - lo) / levels).half(), lo.half()
        codes = torch.round((xb - m.float()[..., None]) / _safe(d)).clamp(0, levels)
        head = [_bytes(d), _bytes(m)]
    codes = codes.to(torch.int64)
    nib = (codes[..., :16] & 15) | ((codes[..., 16:] & 15) << 4)
    if bits == 5:
        high = (codes >> 4) & 1  # element j's fifth bit is bit j of the 32-bit qh
        qh = (high << torch.arange(32)).sum(-1)
        head.append(torch.stack([(qh >> (8 * i)) & 255 for i in range(4)], -1).to(torch.uint8))
    return torch.cat([*head, nib.to(torch.uint8)], -1).flatten(-2)


def dequantize(codes: torch.Tensor, kv_type: str) -> torch.Tensor:
    """ggml's blocks [..., D / 32 * bytes] read back as float64 [..., D], following
    dequantize.h: q8_0 x = d * qs[j]; q4_0 x = d * (nibble - 8); q4_1 x = d * nibble + m;
    q5_0 x = d * (q - 16), q5_1 x = d * q + m, with q = nibble | (bit j of qh) << 4; element
    j < 16 is the low nibble of byte j, element j + 16 its high nibble."""
    per_block, block_bytes = _block(kv_type)
    b = codes.reshape(*codes.shape[:-1], codes.shape[-1] // block_bytes, block_bytes)

    def half_at(i):
        return b[..., i : i + 2].contiguous().view(torch.float16).double()

    d = half_at(0)
    if kv_type == "q8_0":
        x = b[..., 2:].contiguous().view(torch.int8).double() * d
    else:
        start = {"q4_0": 2, "q4_1": 4, "q5_0": 6, "q5_1": 8}[kv_type]
        qs = b[..., start : start + 16].to(torch.int64)
        q = torch.cat([qs & 15, qs >> 4], -1)
        if kv_type.startswith("q5"):
            qh_at = start - 4
            qh = sum(b[..., qh_at + i].to(torch.int64) << (8 * i) for i in range(4))
            q = q | (((qh[..., None] >> torch.arange(32)) & 1) << 4)
        if kv_type.endswith("_0"):
            x = (q - (8 if kv_type == "q4_0" else 16)).double() * d
        else:
            x = q.double() * d + half_at(2)
    return x.flatten(-2)


def _safe(d):
    d = d.float()[..., None]
    return torch.where(d == 0, torch.ones_like(d), d)


def _bytes(h):
    return h.contiguous()[..., None].view(torch.uint8)


def run(launch: dict, *, counters: bool = False, checkers: bool | None = None, **options):
    """sim.run_kernel on one launch; `options`: run_kernel's other keywords."""
    return sim.run_kernel(**launch, counters=counters, checkers=checkers, **options)
