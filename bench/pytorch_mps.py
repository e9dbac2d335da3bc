"""PyTorch's own MPS attention kernels in the simulator, bound and chosen as its host code does.

The installed torch wheel ships the sources of its attention kernels (torch/include/ATen/native/
mps/kernels/PrefillAttention.h, DecodeAttention.h). tests/sim/kernels/pytorch_*.metal include
them unmodified, as PyTorch's Attention.metal does; this module gives them the arguments that
PyTorch's host code (aten/src/ATen/native/mps/operations/Attention.mm,
_scaled_dot_product_attention_math_mps) binds, and picks the kernel as that code does. Used by
tests/sim/test_pytorch_corpus.py (the kernels against float64 math) and by
bench/bench_attention.py --predict (their counters beside steel's).

The host's dispatch rules, restated (no code of it is here):
- "vector" (decode) when qL <= 8, qL <= kL, D == Dv in {64, 96, 128, 256}, any mask bool or of
  the query's dtype, and not causal with a mask: two passes when kL >= 1024 (or GQA and
  kL >= 4096, which the first condition already covers), else one pass;
- "prefill" otherwise when qL > 8, kL > 0, D == Dv in {32, 64, 72, 80, 96, 128, 256}, the dtype
  float32/float16/bfloat16 and any mask bool or of the query's dtype;
- otherwise the MPSGraph composite ("general"), which materializes the qL x kL scores.
The newer host source also has a matmul2d prefill ("mpp", M5); the 2.13 wheel ships no such
kernel header, so no chip gets it here.

Kernels and arguments:
- prefill: `prefill_attention_<float32|float16|bfloat16>_bq<BQ>_bk<BK>_bd<D>_wm<WM>_wn<WN>
  _hm<has mask>_dc<causal>_mask<bool_|dtype>`, (BQ, BK, WM, WN) = (16, 8, 2, 1) for D = 256,
  (32, 16, 4, 1) for 128, (32, 32, 4, 1) for 32/64/72/80/96; grid (ceil(qL / BQ), H, B),
  threadgroup (32, WM, WN); buffers Q, K, V, O, the params struct (B, H, D, qL, kL, gqa factor,
  scale, softcapping 1.0, Q/K/V/O strides of B, H, L), then the mask's strides and the mask, or
  a 4-byte dummy in slots 5 and 6.
- decode, one pass: `sdpa_vector_<float|half|bfloat>_<D>_<D>_mask<none|bool|dtype>[_causal]`,
  grid (B * H, qL, 1), 1024 threads; buffers Q, K, V, O, gqa factor, kL, the head strides and
  sequence strides of Q, K, V (three uint32 each), scale, then only with a mask: the mask
  (expanded to B, H, qL, kL) and its strides (kL, qL, head, batch; 0 where the size is 1); and
  in slot 11 the batch strides and H.
- decode, two passes: pass 1 `sdpa_vector_2pass_1_...` on grid (B * H, qL, 32) of 256 threads
  into partials [B, H, qL, 32, D] (query dtype) and float sums and maxima [B, H, qL, 32]
  (slots 3-5; the rest as above, shifted by two); pass 2 `sdpa_vector_2pass_2_<dtype>_<D>` on
  grid (B * H, qL, 1) of 1024 threads: partials, sums, maxima, O.

The prefill params struct is laid out as the wheel's header declares it (int strides): the host
source read fills int64_t strides into a struct it says must match, which does not match this
header; the kernel is given what it reads.

A launch is a dict of sim.run_kernel's keywords; `threadgroup_memory_bytes` is the static
threadgroup memory the kernel declares (from the header's arrays), for the timing model.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import torch

from torch_steel import sim
from torch_steel.sim import build

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "tests" / "sim" / "kernels"
TORCH_INCLUDE = Path(torch.__file__).parent / "include"
HEADERS = [
    "ATen/native/mps/kernels/PrefillAttention.h",
    "ATen/native/mps/kernels/DecodeAttention.h",
]

METAL_NAMES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat"}
PREFILL_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
VECTOR_HEAD_DIMS = (64, 96, 128, 256)
PREFILL_HEAD_DIMS = (32, 64, 72, 80, 96, 128, 256)
TWO_PASS_BLOCKS = 32


def available() -> bool:
    """The wheel ships the kernel headers."""
    return all((TORCH_INCLUDE / h).is_file() for h in HEADERS)


def include_dir() -> Path:
    """The wheel's kernel headers and c10/metal/, copied as they are to a fixed place under the
    simulator's cache (a fixed path keeps the built library cached between runs)."""
    dest = build.cache_root() / f"torch-{torch.__version__}-include"
    for sub in ("ATen/native/mps/kernels", "c10/metal"):
        (dest / sub).mkdir(parents=True, exist_ok=True)
        for h in (TORCH_INCLUDE / sub).glob("*.h"):
            target = dest / sub / h.name
            if not target.exists() or target.read_bytes() != h.read_bytes():
                shutil.copyfile(h, target)
    return dest


def prefill_shape(D: int) -> tuple[int, int, int, int]:
    """(BQ, BK, WM, WN) of the prefill kernel for head dim D."""
    return {256: (16, 8, 2, 1), 128: (32, 16, 4, 1)}.get(D, (32, 32, 4, 1))


def choose(qL, kL, D, Dv, dtype, causal=False, mask=None) -> str:
    """The path PyTorch's host takes: "vector", "vector_2pass", "prefill" or "general"."""
    mask_ok = mask is None or mask.dtype in (torch.bool, dtype)
    vector = qL <= 8 and qL <= kL and mask_ok and D == Dv and D in VECTOR_HEAD_DIMS
    if vector and not (causal and mask is not None):
        return "vector_2pass" if kL >= 1024 else "vector"
    if (
        qL > 8
        and kL > 0
        and dtype in PREFILL_NAMES
        and mask_ok
        and D == Dv
        and D in PREFILL_HEAD_DIMS
    ):
        return "prefill"
    return "general"


def _prefill_tg_bytes(BQ, BK, D, es):
    pad = 16 // es
    return es * (BQ * (D + pad) + max((BK + pad) * D, BK * (D + pad)))


def prefill_launch(q, k, v, out, scale, causal=False, mask=None) -> dict:
    """The prefill kernel's launch (mask: None, bool or of q's dtype, broadcastable to
    [B, H, qL, kL] and already expanded to 4-D)."""
    B, H, qL, D = q.shape
    kL = k.shape[2]
    dtype = q.dtype
    BQ, BK, WM, WN = prefill_shape(D)
    strides = [*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3]]
    params = struct.pack("<6i2f12i", B, H, D, qL, kL, H // k.shape[1], scale, 1.0, *strides)
    if mask is None:
        extra = {5: struct.pack("<I", 0), 6: struct.pack("<I", 0)}
        mask_name = PREFILL_NAMES[dtype]
    else:
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        extra = {5: struct.pack("<4i", *mask.stride()), 6: mask}
        mask_name = "bool_" if mask.dtype == torch.bool else PREFILL_NAMES[dtype]
    name = (
        f"prefill_attention_{PREFILL_NAMES[dtype]}_bq{BQ}_bk{BK}_bd{D}_wm{WM}_wn{WN}"
        f"_hm{int(mask is not None)}_dc{int(causal)}_mask{mask_name}"
    )
    return {
        "name": name,
        "sources": [KERNELS / "pytorch_prefill.metal"],
        "include_dirs": [include_dir()],
        "grid": (-(-qL // BQ), H, B),
        "threads": (32, WM, WN),
        "buffers": {0: q, 1: k, 2: v, 3: out, 4: params, **extra},
        "threadgroup_memory_bytes": _prefill_tg_bytes(BQ, BK, D, q.element_size()),
    }


def _decode_args(q, k, v, scale, mask, first_mask_slot):
    """Slots from gqa_factor on, as the host binds them (mask and its strides only with a mask)."""
    B, H, qL, D = q.shape
    kL = k.shape[2]
    slots = {
        first_mask_slot - 5: struct.pack("<I", H // k.shape[1]),
        first_mask_slot - 4: struct.pack("<I", kL),
        first_mask_slot - 3: struct.pack("<3I", q.stride(1), k.stride(1), v.stride(1)),
        first_mask_slot - 2: struct.pack("<3I", q.stride(2), k.stride(2), v.stride(2)),
        first_mask_slot - 1: struct.pack("<f", scale),
        first_mask_slot + 2: struct.pack("<4I", q.stride(0), k.stride(0), v.stride(0), H),
    }
    if mask is not None:
        m = mask.expand(B, H, qL, kL)
        st = [s if n > 1 else 0 for s, n in zip(m.stride(), m.shape, strict=True)]
        slots[first_mask_slot] = m
        slots[first_mask_slot + 1] = struct.pack("<4I", st[3], st[2], st[1], st[0])
    return slots


def _decode_name(prefix, dtype, D, mask, causal):
    suffix = (
        "none" if mask is None else ("bool" if mask.dtype == torch.bool else METAL_NAMES[dtype])
    )
    return f"{prefix}_{METAL_NAMES[dtype]}_{D}_{D}_mask{suffix}{'_causal' if causal else ''}"


def vector_launch(q, k, v, out, scale, causal=False, mask=None) -> dict:
    """The one-pass decode kernel's launch."""
    B, H, qL, D = q.shape
    return {
        "name": _decode_name("sdpa_vector", q.dtype, D, mask, causal),
        "sources": [KERNELS / "pytorch_decode.metal"],
        "include_dirs": [include_dir()],
        "grid": (B * H, qL, 1),
        "threads": (1024,),
        "buffers": {0: q, 1: k, 2: v, 3: out, **_decode_args(q, k, v, scale, mask, 9)},
        "threadgroup_memory_bytes": (32 * 32 + 2 * 32) * 4,
    }


def vector_2pass_launches(q, k, v, out, scale, causal=False, mask=None) -> list[dict]:
    """The two-pass decode kernels' launches, with the intermediates allocated as the host does
    (filled with NaN: Metal buffers start uninitialized)."""
    B, H, qL, D = q.shape
    blocks = TWO_PASS_BLOCKS
    partials = torch.full((B, H, qL, blocks, D), float("nan"), dtype=q.dtype)
    sums = torch.full((B, H, qL, blocks), float("nan"))
    maxs = torch.full((B, H, qL, blocks), float("nan"))
    pass1 = {
        "name": _decode_name("sdpa_vector_2pass_1", q.dtype, D, mask, causal),
        "sources": [KERNELS / "pytorch_decode.metal"],
        "include_dirs": [include_dir()],
        "grid": (B * H, qL, blocks),
        "threads": (8 * 32,),
        "buffers": {
            0: q,
            1: k,
            2: v,
            3: partials,
            4: sums,
            5: maxs,
            **_decode_args(q, k, v, scale, mask, 11),
        },
        "threadgroup_memory_bytes": (8 * 32 + 2 * 8) * 4,
    }
    pass2 = {
        "name": f"sdpa_vector_2pass_2_{METAL_NAMES[q.dtype]}_{D}",
        "sources": [KERNELS / "pytorch_decode.metal"],
        "include_dirs": [include_dir()],
        "grid": (B * H, qL, 1),
        "threads": (1024,),
        "buffers": {0: partials, 1: sums, 2: maxs, 3: out},
        "threadgroup_memory_bytes": 32 * 32 * 4,
    }
    return [pass1, pass2]


def launches(q, k, v, *, scale=None, causal=False, mask=None) -> tuple[torch.Tensor, list[dict]]:
    """(out, the launches PyTorch's host would encode) for F.sdpa(q, k, v) without grad on
    [B, H, L, D] CPU tensors. Raises ValueError on the MPSGraph path ("general"), which runs no
    kernel of the wheel (the bench models it from its ops)."""
    B, H, qL, D = q.shape
    path = choose(qL, k.shape[2], D, v.shape[-1], q.dtype, causal, mask)
    if path == "general":
        raise ValueError(f"PyTorch runs this shape through MPSGraph, not its kernels: {q.shape}")
    if scale is None:
        scale = D**-0.5
    if mask is not None:
        mask = mask.expand(B, H, qL, k.shape[2])
    out = torch.full((B, H, qL, v.shape[-1]), float("nan"), dtype=q.dtype)
    if path == "prefill":
        return out, [prefill_launch(q, k, v, out, scale, causal, mask)]
    if path == "vector":
        return out, [vector_launch(q, k, v, out, scale, causal, mask)]
    return out, vector_2pass_launches(q, k, v, out, scale, causal, mask)


def run(launch: dict, *, counters: bool = False, checkers: bool | None = None, **options):
    """sim.run_kernel on one launch (the static threadgroup memory is the kernel's own, not a
    binding: it is left out of the call); `options`: run_kernel's other keywords (cache=,
    sample=)."""
    kw = {key: val for key, val in launch.items() if key != "threadgroup_memory_bytes"}
    return sim.run_kernel(**kw, counters=counters, checkers=checkers, **options)


def records(q, k, v, *, scale=None, causal=False, mask=None, checkers=False) -> tuple:
    """(out, per-dispatch records) of PyTorch's kernels on these inputs: each record has the
    dispatch's `kernel`, `grid`, `threads`, `threadgroup_memory` (bytes) and the simulator's
    `counters`, the form bench_attention.py builds for steel's plans. Checkers are off by
    default (the bench wants counters; the corpus test runs these kernels with them on)."""
    out, ls = launches(q, k, v, scale=scale, causal=causal, mask=mask)
    result = []
    for launch in ls:
        c = run(launch, counters=True, checkers=checkers)
        result.append(
            {
                "kernel": launch["name"],
                "grid": tuple(launch["grid"]) + (1,) * (3 - len(launch["grid"])),
                "threads": tuple(launch["threads"]) + (1,) * (3 - len(launch["threads"])),
                "threadgroup_memory": launch["threadgroup_memory_bytes"],
                "counters": c,
            }
        )
    return out, result
