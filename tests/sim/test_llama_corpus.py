"""llama.cpp's production Metal flash attention as a standing corpus (issue 26, deliverable 3).

ggml's fa_f16.metal (kernel_flash_attn_ext_f16_dk<D>_dv<D>, f16 K/V, with its own
instantiations) and fa_aux.metal (the pad and mask-block kernels that its host runs first), from
the pinned llama-cpp-python source distribution (bench/corpora.LLAMA, fetched at test time and
cached beside the simulator's build), compiled unmodified and run with the arguments ggml's
Metal host binds (bench/llama_metal.py restates them), checkers on, against float64 attention
on ragged sizes (query counts no multiple of the 8 a threadgroup takes, key counts no multiple
of the 64 a simdgroup step takes). Offline the tests skip and say why.

The first case runs by default; the rest are slow.
"""

import sys
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel.errors import SimulatorError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import corpora  # noqa: E402
import llama_metal  # noqa: E402

pytestmark = requires_clang


@pytest.fixture(scope="module", autouse=True)
def _sources():
    try:
        llama_metal.source_dir()
    except corpora.CorpusUnavailable as e:
        pytest.skip(f"llama.cpp corpus unavailable: {e}")


def _inputs(B, H, Hkv, n_q, n_kv, D, seed, masked=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n_q, D, generator=g)
    k = torch.randn(B, Hkv, n_kv, D, generator=g).half()
    v = torch.randn(B, Hkv, n_kv, D, generator=g).half()
    mask = None
    if masked:
        # ggml's KQ mask: float16, 0 where a key is seen and -inf where not, shared by heads.
        keep = torch.rand(B, 1, n_q, n_kv, generator=g) > 0.3
        keep[..., 0] = True  # every row sees a key
        mask = torch.zeros(B, 1, n_q, n_kv).masked_fill(~keep, float("-inf")).half()
    return q, k, v, mask


def _reference(q, k, v, scale, mask):
    """float64 attention of the values the kernel computes with: it stores Q in float16
    (FA_TYPES' q_t) before the products, and K, V are float16; result [B, n_q, H, DV], as
    ggml lays it out."""
    g = q.shape[1] // k.shape[1]
    qd = q.half().double()
    kd, vd = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = qd @ kd.transpose(-1, -2) * scale
    if mask is not None:
        s = s + mask.double()
    return (torch.softmax(s, -1) @ vd).transpose(1, 2)


# Key counts are even: the kernel reads mask rows as half2, so ggml's KQ mask rows (n_kv
# halves; llama.cpp pads its KV cache to 256 cells) start 4-byte aligned only then.
CASES = [
    # D, B, H, Hkv, n_q, n_kv
    pytest.param(64, 1, 2, 1, 13, 100, id="d64-gqa-13x100"),
    pytest.param(128, 2, 2, 2, 31, 66, id="d128-b2-31x66", marks=pytest.mark.slow),
    pytest.param(64, 1, 2, 2, 8, 128, id="d64-8x128-aligned", marks=pytest.mark.slow),
    pytest.param(256, 1, 4, 1, 9, 130, id="d256-gqa4-9x130", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("D,B,H,Hkv,n_q,n_kv", CASES)
def test_flash_attn_ext_f16(D, B, H, Hkv, n_q, n_kv):
    q, k, v, mask = _inputs(B, H, Hkv, n_q, n_kv, D, seed=D + n_kv)
    out = torch.full((B, n_q, H, D), float("nan"))
    scale = D**-0.5
    for launch in llama_metal.flash_attn_launches(q, k, v, out, scale, mask):
        llama_metal.run(launch, checkers=True)
    ref = _reference(q, k, v, scale, mask)
    # Past the float16 Q (in the reference), scores, softmax and P x V stay in float32 and the
    # result is stored as float32: within a few float32 roundoffs of the largest |V| (the
    # output is a convex combination of V rows).
    bound = 8 * 2.0**-24 * float(v.double().abs().max())
    err = float((out.double() - ref).abs().max())
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


def test_flash_attn_ext_without_a_mask_divides_by_zero():
    """llama.cpp defect: kernel_flash_attn_ext_impl computes the mask's row pointers and block
    map offset as `iq2 % args.ne32` and `iq3 % args.ne33` whether or not there is a mask, and
    without one the host passes the mask's extents as 0 (GGML_TENSOR_LOCALS of a null tensor):
    an integer division by zero, undefined in MSL (C++ rules), whose results the kernel then
    leaves unused. Harmless where the GPU's remainder by zero does not trap; the simulator
    stops there, so the numbers are checked with a mask (test_flash_attn_ext_f16)."""
    q, k, v, _ = _inputs(1, 2, 1, 13, 100, 64, seed=164, masked=False)
    out = torch.full((1, 13, 2, 64), float("nan"))
    pad, attention = llama_metal.flash_attn_launches(q, k, v, out, 64**-0.5)
    llama_metal.run(pad, checkers=True)
    with pytest.raises(SimulatorError, match="integer division by zero"):
        llama_metal.run(attention, checkers=True)
