"""PyTorch's own Metal attention kernels as a standing corpus (issue 14, deliverable 2).

The prefill kernel (PrefillAttention.h) and the one-pass and two-pass decode kernels
(DecodeAttention.h) that the installed torch wheel ships under torch/include, with the c10/metal/
headers they include, are compiled unmodified (tests/sim/kernels/pytorch_*.metal only include
them, as PyTorch's Attention.metal does) and run with the arguments PyTorch's host code
(aten/src/ATen/native/mps/operations/Attention.mm) binds, checkers on, against float64 math.

What that host code does, restated (no code of it is here):
- prefill: kernel `prefill_attention_<float32|float16|bfloat16>_bq<BQ>_bk<BK>_bd<D>_wm<WM>_wn<WN>
  _hm<has mask>_dc<causal>_mask<bool_|dtype>`, (BQ, BK, WM, WN) = (16, 8, 2, 1) for D = 256,
  (32, 16, 4, 1) for 128, (32, 32, 4, 1) for 32/64/72/80/96; grid (ceil(qL / BQ), H, B),
  threadgroup (32, WM, WN); buffers Q, K, V, O, the params struct (B, H, D, qL, kL, gqa factor,
  scale, softcapping 1.0, Q/K/V/O strides of B, H, L), then the mask's strides and the mask, or
  a 4-byte dummy in slots 5 and 6. Used for qL > 8 when the decode kernels do not apply.
- decode, one pass (qL <= 8, qL <= kL, D in 64/96/128/256, kL < 1024): `sdpa_vector_<float|half|
  bfloat>_<D>_<D>_mask<none|bool|dtype>[_causal]`, grid (B * H, qL, 1), 1024 threads; buffers
  Q, K, V, O, gqa factor, kL, the head strides and sequence strides of Q, K, V (three uint32
  each, 12 bytes), scale, then only with a mask: the mask (expanded to B, H, qL, kL) and its
  strides (kL, qL, head, batch; 0 where the size is 1); and in slot 11 the batch strides and H.
- decode, two passes (kL >= 1024): pass 1 `sdpa_vector_2pass_1_...` on grid (B * H, qL, 32) of
  256 threads into partials [B, H, qL, 32, D] (query dtype) and float sums and maxima
  [B, H, qL, 32] (slots 3-5; the rest as above, shifted by two); pass 2 `sdpa_vector_2pass_2_
  <dtype>_<D>` on grid (B * H, qL, 1) of 1024 threads: partials, sums, maxima, O.

The prefill params struct is laid out as the wheel's header declares it (int strides): the host
in the PyTorch source read here fills int64_t strides into a struct it says must match, which
does not match this header; the layouts of other releases may differ, so the kernel is given
what it reads.
"""

import shutil
import struct
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel import sim
from torch_steel.errors import SimulatorError
from torch_steel.sim import build

KERNELS = Path(__file__).parent / "kernels"
TORCH_INCLUDE = Path(torch.__file__).parent / "include"
HEADERS = [
    "ATen/native/mps/kernels/PrefillAttention.h",
    "ATen/native/mps/kernels/DecodeAttention.h",
]

pytestmark = [
    requires_clang,
    pytest.mark.slow,
    pytest.mark.skipif(
        not all((TORCH_INCLUDE / h).is_file() for h in HEADERS),
        reason="this torch wheel ships no MPS attention kernels",
    ),
]

_METAL_NAMES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat"}
_PREFILL_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Unit roundoff of the storage types (a value stored is within this relative error).
_EPS = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.fixture(scope="module")
def include_dir():
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


def _launch(name, source, include_dir, **kw):
    return sim.run_kernel(
        name, sources=[KERNELS / source], include_dirs=[include_dir], checkers=True, **kw
    )


def _reference(q, k, v, scale, causal=False, mask=None):
    """float64 attention with PyTorch's conventions: upper-left causal, grouped heads, an
    additive or boolean mask, and rows that see no key give 0 (as these kernels do)."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


def _check(out, ref, v, dtype, factor):
    """Within `factor` storage roundoffs of the largest |V| (the output is a convex combination
    of V rows, rounded to the storage type, from scores rounded on the way)."""
    bound = factor * _EPS[dtype] * float(v.double().abs().max())
    err = float((out.double() - ref).abs().max())
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


def _inputs(B, H, Hkv, qL, kL, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, qL, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, kL, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, kL, D, generator=g).to(dtype)
    return q, k, v, g


def _prefill_shape(D):
    return {256: (16, 8, 2, 1), 128: (32, 16, 4, 1)}.get(D, (32, 32, 4, 1))


PREFILL_CASES = [
    # dtype, D, B, H, Hkv, qL, kL, causal, mask
    (torch.float32, 64, 1, 2, 1, 40, 45, False, None),
    (torch.float16, 64, 2, 2, 2, 33, 70, True, None),
    (torch.bfloat16, 128, 1, 2, 1, 20, 37, False, "bool"),
    (torch.float16, 32, 1, 1, 1, 17, 40, False, "additive"),
    (torch.float32, 256, 1, 1, 1, 16, 9, True, "bool"),
]


@pytest.mark.parametrize(
    "dtype,D,B,H,Hkv,qL,kL,causal,mask",
    PREFILL_CASES,
    ids=[
        f"{_PREFILL_NAMES[c[0]]}-d{c[1]}-{'causal' if c[7] else 'full'}-{c[8]}"
        for c in PREFILL_CASES
    ],
)
def test_prefill_attention(include_dir, dtype, D, B, H, Hkv, qL, kL, causal, mask):
    q, k, v, g = _inputs(B, H, Hkv, qL, kL, D, dtype, seed=D + qL)
    m = None
    if mask == "bool":
        m = torch.rand(B, H, qL, kL, generator=g) > 0.3
        m[..., 0] = True  # every row sees a key
    elif mask == "additive":
        m = (torch.randn(B, 1, qL, kL, generator=g) * 2).to(dtype).expand(B, H, qL, kL)
    out = torch.full((B, H, qL, D), float("nan"), dtype=dtype)
    scale = 1.0 / D**0.5
    BQ, BK, WM, WN = _prefill_shape(D)
    strides = [*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3]]
    params = struct.pack("<6i2f12i", B, H, D, qL, kL, H // Hkv, scale, 1.0, *strides)
    if m is None:
        extra = {5: struct.pack("<I", 0), 6: struct.pack("<I", 0)}
        mask_name = _PREFILL_NAMES[dtype]
    else:
        if m.stride(-1) != 1:
            m = m.contiguous()
        extra = {5: struct.pack("<4i", *m.stride()), 6: m}
        mask_name = "bool_" if m.dtype == torch.bool else _PREFILL_NAMES[dtype]
    name = (
        f"prefill_attention_{_PREFILL_NAMES[dtype]}_bq{BQ}_bk{BK}_bd{D}_wm{WM}_wn{WN}"
        f"_hm{int(m is not None)}_dc{int(causal)}_mask{mask_name}"
    )
    _launch(
        name,
        "pytorch_prefill.metal",
        include_dir,
        grid=(-(-qL // BQ), H, B),
        threads=(32, WM, WN),
        buffers={0: q, 1: k, 2: v, 3: out, 4: params, **extra},
    )
    ref = _reference(q, k, v, scale, causal, m)
    # Q is scaled (by scale * log2 e) and stored in the input type before the products.
    _check(out, ref, v, dtype, factor=8 if dtype == torch.float32 else 4)


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
        "none" if mask is None else ("bool" if mask.dtype == torch.bool else _METAL_NAMES[dtype])
    )
    return f"{prefix}_{_METAL_NAMES[dtype]}_{D}_{D}_mask{suffix}{'_causal' if causal else ''}"


def _decode_mask(kind, B, qL, kL, dtype, g):
    if kind == "bool":
        m = torch.rand(B, 1, qL, kL, generator=g) > 0.4
        m[..., 0] = True
        return m
    if kind == "additive":
        return (torch.randn(1, 1, qL, kL, generator=g) * 2).to(dtype)
    return None


DECODE_CASES = [
    # dtype, D, B, H, Hkv, qL, kL, causal, mask
    (torch.float32, 64, 1, 2, 1, 1, 50, False, None),
    (torch.float16, 128, 2, 2, 2, 3, 40, True, None),
    (torch.bfloat16, 64, 1, 2, 2, 4, 33, False, "bool"),
    (torch.float16, 96, 1, 1, 1, 2, 64, False, "additive"),
]


@pytest.mark.parametrize(
    "dtype,D,B,H,Hkv,qL,kL,causal,mask",
    DECODE_CASES,
    ids=[
        f"{_METAL_NAMES[c[0]]}-d{c[1]}-{'causal' if c[7] else 'full'}-{c[8]}" for c in DECODE_CASES
    ],
)
def test_decode_one_pass(include_dir, dtype, D, B, H, Hkv, qL, kL, causal, mask):
    q, k, v, g = _inputs(B, H, Hkv, qL, kL, D, dtype, seed=D + kL)
    m = _decode_mask(mask, B, qL, kL, dtype, g)
    out = torch.full((B, H, qL, D), float("nan"), dtype=dtype)
    scale = 1.0 / D**0.5
    _launch(
        _decode_name("sdpa_vector", dtype, D, m, causal),
        "pytorch_decode.metal",
        include_dir,
        grid=(B * H, qL, 1),
        threads=(1024,),
        buffers={0: q, 1: k, 2: v, 3: out, **_decode_args(q, k, v, scale, m, 9)},
    )
    ref = _reference(q, k, v, scale, causal, None if m is None else m.expand(B, H, qL, kL))
    _check(out, ref, v, dtype, factor=8 if dtype == torch.float32 else 2)


TWO_PASS_CASES = [
    (torch.float32, 64, 1, 2, 1, 2, 1030, False, None),
    (torch.float16, 128, 1, 2, 2, 1, 1100, True, None),
    (torch.bfloat16, 64, 1, 1, 1, 3, 1024, False, "bool"),
]


@pytest.mark.parametrize(
    "dtype,D,B,H,Hkv,qL,kL,causal,mask",
    TWO_PASS_CASES,
    ids=[
        f"{_METAL_NAMES[c[0]]}-d{c[1]}-{'causal' if c[7] else 'full'}-{c[8]}"
        for c in TWO_PASS_CASES
    ],
)
def test_decode_two_pass(include_dir, dtype, D, B, H, Hkv, qL, kL, causal, mask):
    q, k, v, g = _inputs(B, H, Hkv, qL, kL, D, dtype, seed=D + kL)
    m = _decode_mask(mask, B, qL, kL, dtype, g)
    blocks = 32
    partials = torch.full((B, H, qL, blocks, D), float("nan"), dtype=dtype)
    sums = torch.full((B, H, qL, blocks), float("nan"))
    maxs = torch.full((B, H, qL, blocks), float("nan"))
    out = torch.full((B, H, qL, D), float("nan"), dtype=dtype)
    scale = 1.0 / D**0.5
    pass1 = {
        "name": _decode_name("sdpa_vector_2pass_1", dtype, D, m, causal),
        "sources": [KERNELS / "pytorch_decode.metal"],
        "include_dirs": [include_dir],
        "grid": (B * H, qL, blocks),
        "threads": (8 * 32,),
        "buffers": {
            0: q,
            1: k,
            2: v,
            3: partials,
            4: sums,
            5: maxs,
            **_decode_args(q, k, v, scale, m, 11),
        },
    }
    # PyTorch defect (from MLX's kernel): pass 1 stores its block's sum and maximum with
    # `if (simd_gid == 0) { sums[0] = ...; maxs[0] = ...; }`, all 32 lanes of simdgroup 0
    # writing the same float to one address with nothing ordering them: a data race, undefined
    # in MSL's memory model (harmless on today's GPUs, where the lanes store the same value in
    # one instruction; `simd_lid == 0` too would fix it). The checkers report it ...
    race = r"data race on device memory \(byte offset 0 of \[\[buffer\(4\)\]\]\): thread 0 "
    with pytest.raises(SimulatorError, match=race):
        sim.run_kernel(**pass1, checkers=True)
    # ... and without them (on the bytes the race leaves, the same from every lane) the numbers
    # are checked; pass 2 runs with the checkers on.
    sim.run_kernel(**pass1, checkers=False)
    _launch(
        f"sdpa_vector_2pass_2_{_METAL_NAMES[dtype]}_{D}",
        "pytorch_decode.metal",
        include_dir,
        grid=(B * H, qL, 1),
        threads=(1024,),
        buffers={0: partials, 1: sums, 2: maxs, 3: out},
    )
    ref = _reference(q, k, v, scale, causal, None if m is None else m.expand(B, H, qL, kL))
    # The partials are stored in the input type between the passes: one more rounding.
    _check(out, ref, v, dtype, factor=8 if dtype == torch.float32 else 3)
