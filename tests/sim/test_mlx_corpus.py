"""MLX's production Metal as a standing corpus (issue 26, deliverable 3).

MLX's steel GEMM (steel_gemm_fused.h), steel attention (steel_attention.h) and one- and
two-pass vector attention (sdpa_vector.h), from the pinned mlx-metal wheel (bench/corpora.MLX,
fetched at test time and cached beside the simulator's build), compiled unmodified
(tests/sim/kernels/mlx_*.metal only include them and instantiate the templates, as MLX's .metal
files do) and run with the arguments MLX's host code binds (bench/mlx_metal.py restates them),
checkers on, against float64 math on ragged sizes. Offline the tests skip and say why.

The first case of each kernel runs by default; the rest are slow.
"""

import sys
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import corpora  # noqa: E402
import mlx_metal  # noqa: E402

pytestmark = requires_clang

# Unit roundoff of the storage types (a stored value is within this relative error).
_EPS = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.fixture(scope="module", autouse=True)
def _wheel():
    try:
        mlx_metal.include_dir()
    except corpora.CorpusUnavailable as e:
        pytest.skip(f"MLX corpus unavailable: {e}")


def _run(launch):
    mlx_metal.run(launch, checkers=True)


# ---------------------------------------------------------------------------- steel GEMM

GEMM_CASES = [
    # dtype, batch, M, N, K, transpose a, transpose b
    pytest.param(torch.float32, 1, 33, 47, 31, False, False, id="float32-nn-33x47x31"),
    pytest.param(
        torch.float16,
        2,
        40,
        31,
        48,
        False,
        True,
        id="float16-nt-b2-40x31x48",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        torch.bfloat16,
        1,
        64,
        65,
        17,
        True,
        False,
        id="bfloat16-tn-64x65x17",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("dtype,batch,M,N,K,ta,tb", GEMM_CASES)
def test_steel_gemm(dtype, batch, M, N, K, ta, tb):
    g = torch.Generator().manual_seed(M * N + K)
    a = torch.randn(batch, M, K, generator=g).to(dtype)
    b = torch.randn(batch, K, N, generator=g).to(dtype)
    # A transposed operand is stored [K, M] and read through its transpose, as MLX's host sees
    # a column-major matrix.
    if ta:
        a = a.transpose(1, 2).contiguous().transpose(1, 2)
    if tb:
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.full((batch, M, N), float("nan"), dtype=dtype)
    _run(mlx_metal.gemm_launch(a, b, out))
    ref = a.double() @ b.double()
    # float32 accumulation of K products: within K unit roundoffs of sum |a||b| (the standard
    # bound of a recursive sum), plus the rounding of the result to the output type.
    bound = K * 2.0**-24 * (a.double().abs() @ b.double().abs()) + _EPS[dtype] * ref.abs()
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g}"


# ---------------------------------------------------------------------------- attention


def _reference(q, k, v, scale, causal=False, mask=None):
    """float64 attention with MLX's conventions: grouped heads, the causal diagonal at the
    lower right (query i sees keys up to i + kL - qL), a boolean mask keeps True, an additive
    one adds."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    qL, kL = s.shape[-2:]
    if causal:
        keep = torch.ones(qL, kL, dtype=torch.bool).tril(kL - qL)
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.softmax(s, dim=-1) @ v


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


ATTENTION_CASES = [
    # dtype, D, B, H, Hkv, qL, kL, causal, mask
    pytest.param(torch.float32, 64, 1, 2, 1, 40, 45, False, None, id="float32-d64-gqa"),
    pytest.param(
        torch.float16,
        128,
        1,
        2,
        2,
        33,
        47,
        True,
        None,
        id="float16-d128-causal",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        torch.bfloat16,
        64,
        2,
        1,
        1,
        31,
        63,
        False,
        "bool",
        id="bfloat16-d64-bool",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("dtype,D,B,H,Hkv,qL,kL,causal,mask", ATTENTION_CASES)
def test_steel_attention(dtype, D, B, H, Hkv, qL, kL, causal, mask):
    q, k, v, g = _inputs(B, H, Hkv, qL, kL, D, dtype, seed=D + qL)
    m = None
    if mask == "bool":
        m = torch.rand(B, H, qL, kL, generator=g) > 0.3
        m[..., 0] = True  # every row sees a key
    out = torch.full((B, H, qL, D), float("nan"), dtype=dtype)
    scale = D**-0.5
    _run(mlx_metal.attention_launch(q, k, v, out, scale, causal, m))
    # P is rounded to float32 only (wn = 1 keeps the products in float32): the error is the
    # output's rounding and Q, K, V's, a few roundoffs of the storage type.
    _check(
        out,
        _reference(q, k, v, scale, causal, m),
        v,
        dtype,
        factor=8 if dtype == torch.float32 else 4,
    )


VECTOR_CASES = [
    # dtype, D, B, H, Hkv, qL, kL, causal, mask
    pytest.param(torch.float32, 64, 1, 4, 2, 1, 33, False, None, id="float-d64-gqa"),
    pytest.param(
        torch.float16,
        128,
        2,
        2,
        2,
        3,
        63,
        True,
        None,
        id="float16-d128-causal",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        torch.bfloat16,
        64,
        1,
        2,
        1,
        2,
        65,
        False,
        "bool",
        id="bfloat16-d64-bool",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        torch.float16,
        128,
        1,
        2,
        2,
        1,
        40,
        False,
        "additive",
        id="float16-d128-additive",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("dtype,D,B,H,Hkv,qL,kL,causal,mask", VECTOR_CASES)
def test_sdpa_vector(dtype, D, B, H, Hkv, qL, kL, causal, mask):
    q, k, v, g = _inputs(B, H, Hkv, qL, kL, D, dtype, seed=D + kL)
    m = None
    if mask == "bool":
        m = torch.rand(B, H, qL, kL, generator=g) > 0.4
        m[..., 0] = True
    elif mask == "additive":
        m = (torch.randn(1, 1, qL, kL, generator=g) * 2).to(dtype)
    out = torch.full((B, H, qL, D), float("nan"), dtype=dtype)
    scale = D**-0.5
    _run(mlx_metal.vector_launch(q, k, v, out, scale, causal, m))
    # Scores and the running sums stay in float32; Q is scaled then stored in float32.
    _check(
        out,
        _reference(q, k, v, scale, causal, m),
        v,
        dtype,
        factor=8 if dtype == torch.float32 else 2,
    )


VECTOR_2PASS_CASES = [
    # dtype, D, B, H, Hkv, qL, kL, causal, mask. 32 blocks (gqa * qL < 4) over 150 keys: every
    # block takes one 4-key prefetch step (keys b + 32t), then blocks 0-21 one key more. 64
    # blocks over 301 keys: one step each, then blocks 0-44 one more.
    pytest.param(torch.float16, 128, 1, 4, 2, 1, 150, False, None, id="float16-d128-gqa"),
    pytest.param(
        torch.bfloat16,
        64,
        2,
        4,
        2,
        2,
        301,
        True,
        None,
        id="bfloat16-d64-gqa-causal",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("dtype,D,B,H,Hkv,qL,kL,causal,mask", VECTOR_2PASS_CASES)
def test_sdpa_vector_2pass(dtype, D, B, H, Hkv, qL, kL, causal, mask):
    q, k, v, _ = _inputs(B, H, Hkv, qL, kL, D, dtype, seed=D + kL)
    out = torch.full((B, H, qL, D), float("nan"), dtype=dtype)
    scale = D**-0.5
    first, second = mlx_metal.vector_2pass_launches(q, k, v, out, scale, causal)
    _run(first)
    _run(second)
    # Scores, sums and maxs stay in float32 (far below the storage roundoff); two roundings to
    # the storage type: the output's, and the partial outputs' between the passes (each partial
    # is block b's exp-weighted sum of V rows, and pass 2 divides their weighted sum by the
    # total weight, so their rounding errors add up to one roundoff of max |V|).
    _check(out, _reference(q, k, v, scale, causal), v, dtype, factor=2)
