"""llama.cpp's production Metal flash attention as a standing corpus (issue 26, deliverable 3).

ggml's fa_f16.metal and fa_<type>.metal (kernel_flash_attn_ext_<type>_dk<D>_dv<D>, the half8x8
kernel), fa_vec_f16.metal and fa_vec_<type>.metal (the vector decode kernel), and fa_aux.metal
(the pad, mask-block, dequantize-to-f16 and reduce kernels its host runs around them), each
with its own instantiations, from the pinned llama-cpp-python source distribution
(bench/corpora.LLAMA, fetched at test time and cached beside the simulator's build), compiled
unmodified and run with the arguments ggml's Metal host binds (bench/llama_metal.py restates
them), checkers on, against float64 attention on ragged sizes (query counts no multiple of the
8 a threadgroup takes, key counts no multiple of the 64 or 32 a simdgroup step takes), f16 and
quantized K/V. Offline the tests skip and say why.

The first case of each test runs by default; the rest are slow.
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
SLOW = pytest.mark.slow


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
# halves; llama.cpp pads its KV cache to 256 cells) start 4-byte aligned only then. Query
# counts below 20 take the vector kernel in ggml's host (llama_metal.kernel_path); the half8x8
# kernel is bound directly for them here, for its partial query blocks.
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


# The vector kernel, the host's choice for n_q < 20 (decode): (Q, NE) None is the baseline the
# host takes for short caches; the others are the tuned instantiations ggml-metal-tuning.cpp's
# table gives some GPU families for longer ones, bound here on short caches. The numbers are
# checked where the kernel does not rely on lockstep lanes: NE > 1 and one simdgroup (see
# test_flash_attn_ext_vec_relies_on_lockstep_lanes for the others).
VEC_CASES = [
    # D, B, H, Hkv, n_q, n_kv, (Q, NE)
    pytest.param(64, 1, 4, 2, 1, 100, None, id="d64-gqa-1x100"),
    pytest.param(64, 2, 2, 2, 3, 64, None, id="d64-b2-3x64-aligned", marks=pytest.mark.slow),
    pytest.param(128, 2, 4, 1, 3, 77, (1, 2), id="d128-q1ne2-gqa4-3x77", marks=pytest.mark.slow),
    pytest.param(128, 1, 2, 1, 5, 45, (2, 2), id="d128-q2ne2-5x45", marks=pytest.mark.slow),
    pytest.param(128, 1, 1, 1, 1, 33, (1, 4), id="d128-q1ne4-1x33", marks=pytest.mark.slow),
]

# llama.cpp defect in every instantiation of kernel_flash_attn_ext_vec: its prologue stores to
# threadgroup memory from several lanes to one address with no barrier between, a data race in
# MSL's memory model; each stores the same value (zeros, or the same Q row), so the values are
# right in any order. Which one the checkers meet first depends on the configuration:
# - fa_vec_common.metal:118, nsg > 1: every simdgroup stores the Q rows to the same place
#   (sq4[qq*PK4 + i]; the buffer has room for nsg copies, the index ignores the simdgroup);
# - :134, NE > 1: "zero out so" offsets so4 by the lane (tiisg) where the lanes of a row
#   share a slot by tx, so lanes tx + NL*ty of different ty zero the same float4s;
# - :140: "zero out shared memory SH" clears SH / 4 elements of ss4, a float4 pointer, where
#   SH counts halves: twice each simdgroup's region, into the next one's and, from the last,
#   into the result scratch that lanes of the same simdgroup have just zeroed.
VEC_ZERO_RACE = r"(?s)data race on threadgroup memory.*fa_vec_common\.metal:(118|134|140):"


def _run_vec(launches):
    """Runs the vector kernel's launches: the pad and reduce kernels with the checkers on; the
    attention kernel first with them on, where they stop at the zeroing race (checked), then
    without them for the numbers."""
    for launch in launches:
        name = launch["name"]
        if (
            name.startswith("kernel_flash_attn_ext_vec_")
            and name != "kernel_flash_attn_ext_vec_reduce"
        ):
            with pytest.raises(SimulatorError, match=VEC_ZERO_RACE):
                llama_metal.run(launch, checkers=True)
            llama_metal.run(launch, checkers=False)
        else:
            llama_metal.run(launch, checkers=True)


@pytest.mark.parametrize("D,B,H,Hkv,n_q,n_kv,config", VEC_CASES)
def test_flash_attn_ext_vec_f16(D, B, H, Hkv, n_q, n_kv, config):
    assert llama_metal.kernel_path(n_q, D, "f16") == "vec"
    q, k, v, mask = _inputs(B, H, Hkv, n_q, n_kv, D, seed=D + n_kv + 1)
    out = torch.full((B, n_q, H, D), float("nan"))
    scale = D**-0.5
    nqptg, ne = config or (1, None)
    launches = llama_metal.flash_attn_vec_launches(q, k, v, out, scale, mask, nqptg=nqptg, ne=ne)
    assert [x["name"] for x in launches][-1] == "kernel_flash_attn_ext_vec_reduce"
    _run_vec(launches)
    ref = _reference(q, k, v, scale, mask)
    # As for the half8x8 kernel: float16 Q, K and V in the reference, float32 past them; the
    # 32 workgroups' partials are merged in float32 too.
    bound = 8 * 2.0**-24 * float(v.double().abs().max())
    err = float((out.double() - ref).abs().max())
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize(
    "D,n_kv",
    [
        pytest.param(128, 77, id="d128-baseline-ne1"),
        pytest.param(64, 2113, id="d64-nsg2", marks=pytest.mark.slow),
    ],
)
def test_flash_attn_ext_vec_relies_on_lockstep_lanes(D, n_kv):
    """llama.cpp defect: two stores of kernel_flash_attn_ext_vec overwrite threadgroup memory
    that other lanes of the simdgroup are still to read, with no barrier between; correct only
    where a simdgroup's lanes run in lockstep, which MSL does not promise (a write after a read
    by another lane needs simdgroup_barrier or threadgroup_barrier, as a read after a write
    does).
    - NE = 1 (the baseline for DK 128, 256 and 512, llama.cpp's usual decode): after the loop
      over the cache, lane 0 stores S and M to ss[0], ss[1] while the other lanes' last P x V
      reads of ss (no collective after them when NE = 1) may be pending
      (fa_vec_common.metal:572).
    - nsg > 1 (n_kv > 2048): in the merge of the simdgroups' results every lane reads S and M
      from ss and lane 0 then stores the merged pair there (:600).
    The checkers stop at the prologue's race first (VEC_ZERO_RACE); run without them, in the
    order the simulator gives the lanes (each runs to its next rendezvous in turn, an order
    MSL allows), lanes 1-31 read lane 0's S and M as P or as their own M0, and the result is
    wrong. On a copy of the kernel with a simdgroup_barrier before each store it matches
    float64 (checked while writing this test; nothing of theirs is changed here)."""
    q, k, v, mask = _inputs(1, 2, 1, 1, n_kv, D, seed=D + n_kv + 2)
    out = torch.full((1, 1, 2, D), float("nan"))
    scale = D**-0.5
    launches = llama_metal.flash_attn_vec_launches(q, k, v, out, scale, mask)
    _run_vec(launches)
    bound = 8 * 2.0**-24 * float(v.double().abs().max())
    err = float((out.double() - _reference(q, k, v, scale, mask)).abs().max())
    assert err > 100 * bound, f"max error {err:.3g}: the lane order no longer exposes it"


# Quantized K/V (ggml's q8_0, q4_0, q4_1, q5_1 blocks, written by llama_metal.quantize; q5_0's
# dequantization reads misaligned, test_kv_f16_dequantize), each kernel
# path the host takes for them (llama_metal.kernel_path): the vector kernels fa_vec_<type>.metal
# (n_q < 20), the half8x8 kernels fa_<type>.metal (20 <= n_q < 32), and for n_q >= 32 ggml's
# dequantize-to-f16 kernels then the f16 half8x8 kernel.
QUANT_CASES = [
    # kv_type, D, B, H, Hkv, n_q, n_kv, vector (Q, NE) or None
    pytest.param("q8_0", 64, 1, 4, 2, 1, 100, None, id="vec-q8_0-d64-gqa-1x100"),
    pytest.param("q4_0", 64, 1, 4, 2, 1, 100, None, id="vec-q4_0-d64-gqa-1x100", marks=SLOW),
    pytest.param("q4_1", 64, 1, 2, 1, 1, 40, None, id="vec-q4_1-d64-1x40", marks=SLOW),
    pytest.param("q8_0", 128, 1, 2, 1, 3, 77, (1, 2), id="vec-q8_0-d128-q1ne2-3x77", marks=SLOW),
    pytest.param("q8_0", 64, 1, 2, 1, 21, 100, None, id="half8x8-q8_0-d64-21x100", marks=SLOW),
    pytest.param("q4_0", 64, 1, 2, 1, 21, 100, None, id="half8x8-q4_0-d64-21x100", marks=SLOW),
    pytest.param("q8_0", 64, 1, 2, 1, 33, 70, None, id="kv_f16-q8_0-d64-33x70", marks=SLOW),
    pytest.param("q4_0", 64, 1, 2, 1, 33, 70, None, id="kv_f16-q4_0-d64-33x70", marks=SLOW),
    pytest.param("q5_1", 64, 1, 2, 1, 1, 40, None, id="vec-q5_1-d64-1x40", marks=SLOW),
    pytest.param("q5_1", 64, 1, 2, 1, 33, 70, None, id="kv_f16-q5_1-d64-33x70", marks=SLOW),
]


@pytest.mark.parametrize("kv_type,D,B,H,Hkv,n_q,n_kv,config", QUANT_CASES)
def test_flash_attn_ext_quantized(kv_type, D, B, H, Hkv, n_q, n_kv, config):
    q, kf, vf, mask = _inputs(B, H, Hkv, n_q, n_kv, D, seed=D + n_kv + 3)
    k = llama_metal.quantize(kf.float(), kv_type)
    v = llama_metal.quantize(vf.float(), kv_type)
    out = torch.full((B, n_q, H, D), float("nan"))
    scale = D**-0.5
    if config is None:
        launches = llama_metal.launches(q, k, v, out, scale, mask, kv_type)
    else:
        launches = llama_metal.flash_attn_vec_launches(
            q, k, v, out, scale, mask, kv_type, nqptg=config[0], ne=config[1]
        )
    _run_vec(launches)
    # The oracle: float64 attention over the cache read back from its blocks by
    # llama_metal.dequantize (ggml's formulas, test_kv_f16_dequantize checks it against ggml's
    # own kernel), rounded to float16 as every path holds K and V (k4_t / k_t half, or the f16
    # scratch); past that as for f16 K/V.
    kd = llama_metal.dequantize(k, kv_type).half()
    vd = llama_metal.dequantize(v, kv_type).half()
    ref = _reference(q, kd, vd, scale, mask)
    bound = 8 * 2.0**-24 * float(vd.double().abs().max())
    err = float((out.double() - ref).abs().max())
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_kv_f16_dequantize(kv_type):
    """ggml's kernel_flash_attn_ext_kv_<type>_f16 (its dequantize_<type> of dequantize.h) on
    blocks written by llama_metal.quantize reads back what llama_metal.dequantize does, to the
    bit once rounded to float16 (every product d * q is exact in float32), and within a step
    of the input. q5_0: a llama.cpp defect, dequantize_q5_0 loads the block's 32-bit qh
    through a uint32_t pointer at byte 2 of a 22-byte block, misaligned in every other block
    (MSL requires a type's alignment; the checkers stop there), so it is run without them;
    q5_1's qh is at byte 4 of 24 and aligned."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 2, 5, 64, generator=g)
    codes = llama_metal.quantize(x, kv_type)
    dst = torch.full((1, 2, 5, 64), float("nan"), dtype=torch.float16)
    launch = llama_metal.kv_f16_launch(codes, kv_type, dst)
    if kv_type == "q5_0":
        with pytest.raises(SimulatorError, match="misaligned device read of 4 bytes"):
            llama_metal.run(launch, checkers=True)
        llama_metal.run(launch, checkers=False)
    else:
        llama_metal.run(launch, checkers=True)
    back = llama_metal.dequantize(codes, kv_type)
    assert torch.equal(dst, back.half())
    # A step: 2 max|x| / 254, 15 or 31 codes over the block's range bounds d, the largest
    # error being d / 2, or d for the -8 d (-16 d) end the _0 types clamp to 7 d (15 d).
    levels = {"q8_0": 254, "q4_0": 15, "q4_1": 15, "q5_0": 31, "q5_1": 31}[kv_type]
    blocks = x.double().reshape(1, 2, 5, 2, 32)
    step = 2 * blocks.abs().amax(-1, keepdim=True) / levels
    assert bool(((back.reshape(blocks.shape) - blocks).abs() <= step + 1e-3).all())


def _cache_inputs(n_q, n_kv, kv_size, D, seed, H=2, Hkv=2):
    """Q, the mask and K/V as llama.cpp's KV cache holds them (llama_kv_cache::get_k/get_v
    with flash attention): one [cells, KV heads, D] float16 tensor per layer, of kv_size cells,
    and the op's K and V views of its first n_kv cells, [1, Hkv, n_kv, D] with strides."""
    q, _, _, mask = _inputs(1, H, Hkv, n_q, n_kv, D, seed)
    g = torch.Generator().manual_seed(seed + 1)
    k_cache = torch.randn(1, kv_size, Hkv, D, generator=g).half()
    v_cache = torch.randn(1, kv_size, Hkv, D, generator=g).half()
    k = k_cache[:, :n_kv].permute(0, 2, 1, 3)
    v = v_cache[:, :n_kv].permute(0, 2, 1, 3)
    return q, k, v, mask


# Head dim 96, prefill (n_q >= 20 takes the half8x8 kernel): its P x V loads 8x8 tiles of V
# at columns 8 * sgitg + {0, 32, 64, 96} of each row (fa_common.metal:515, DV > 64), the row
# padded to PV = pad64(DV) = 128 columns, so it reads columns 96-127, 64 bytes past each row of
# V, and discards what they give. Within llama.cpp's cache those bytes are the next KV head's
# or the next cell's; llama.cpp pads n_kv to 256 cells (llama_kv_cache::get_n_kv), so there is
# no pad scratch and the last rows are read from the cache itself.
D96 = dict(n_q=21, n_kv=256, D=96)


@pytest.mark.slow
def test_flash_attn_ext_d96_in_a_kv_cache():
    """A cache of more cells than n_kv: the overread lands in cells past n_kv, inside the
    cache's buffer; the numbers match."""
    q, k, v, mask = _cache_inputs(kv_size=512, seed=96, **D96)
    out = torch.full((1, D96["n_q"], 2, 96), float("nan"))
    scale = 96**-0.5
    for launch in llama_metal.launches(q, k, v, out, scale, mask):
        llama_metal.run(launch, checkers=True)
    ref = _reference(q, k, v, scale, mask)
    bound = 8 * 2.0**-24 * float(v.double().abs().max())
    err = float((out.double() - ref).abs().max())
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


@pytest.mark.slow
def test_flash_attn_ext_d96_full_cache_reads_past_v():
    """llama.cpp defect: when the cache is full (n_kv == kv_size), the last cell's last KV head
    is the end of the V tensor, and the kernel reads up to 64 bytes past it. In llama.cpp that
    tensor is the last layer's V, allocated last in the cache's buffer, and with the context
    padded to 256 cells its size (96 * 2 bytes * KV heads * cells) is a whole number of 16 KiB
    pages, which Metal's buffer is rounded to: the read leaves the MTLBuffer (an inference
    from their host code; not run on a GPU). Our earlier binding, V as an exactly sized
    [B, Hkv, n_kv, 96] tensor, met the same read at its last row: the kernel's, not the
    binding's."""
    q, k, v, mask = _cache_inputs(kv_size=256, seed=97, **D96)
    out = torch.full((1, D96["n_q"], 2, 96), float("nan"))
    *prologue, attention = llama_metal.launches(q, k, v, out, 96**-0.5, mask)
    for launch in prologue:
        llama_metal.run(launch, checkers=True)
    with pytest.raises(SimulatorError, match=r"(?s)out-of-bounds device read.*\[\[buffer\(3\)\]\]"):
        llama_metal.run(attention, checkers=True)


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
