"""bench/corpus_counters.py (issue 26, deliverable 5): one small shape per family through its
compare(), each side's counters checked against what its tile math and its loads imply, worked
out here independently of the counters:

- MMAs: a kernel that computes S = Q K^T and O += P V on tiles of BQ query rows by BK keys runs
  2 * (BQ / 8) * (BK / 8) * (D / 8) simdgroup 8x8x8 MMAs per tile it visits; a GEMM on BM x BN
  tiles with a K step of BK runs (BM / 8) * (BN / 8) * (BK / 8) per step, the last step padded
  to BK (both GEMMs load a zero-filled last tile and multiply it whole).
- device bytes: every input byte is read at least once and every output byte written exactly
  once; an operand tile re-read by each threadgroup along the other dimension is read that many
  times (each threadgroup's loads stop at the tensor's edge), which gives exact byte counts.
- DRAM: the cache model fetches each input byte at least once.

Skips when a corpus cannot be fetched (offline); the last test checks that the bench itself
skips such a corpus with its reason and still runs steel's side.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import corpora  # noqa: E402
import corpus_counters as cc  # noqa: E402
import llama_metal  # noqa: E402
import mlx_metal  # noqa: E402
import pytorch_mps  # noqa: E402

pytestmark = requires_clang

CHIP = "M1"


@pytest.fixture(scope="module")
def _corpora():
    if not pytorch_mps.available():
        pytest.skip("this torch wheel ships no Metal kernel headers")
    try:
        mlx_metal.include_dir()
        llama_metal.source_dir()
    except corpora.CorpusUnavailable as e:
        pytest.skip(f"a corpus is unavailable: {e}")


def _sides(case):
    """{label: (dispatches, totals)} of every side of compare(case) on CHIP."""
    result = cc.compare(case, (CHIP,))
    assert not result["skipped"], result["skipped"]
    assert cc.table(result, (CHIP,)).count("\n") > 20  # the bench's table renders
    runs = {s["label"]: s["by_chip"][CHIP]["dispatches"] for s in result["sides"]}
    return {label: (d, cc.totals(d)) for label, d in runs.items()}


def _nbytes(shape, dtype):
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _check_compulsory(totals, inputs, out_bytes):
    """Each input read at least once, the output written exactly once, and the cache model's
    DRAM reads at least the inputs."""
    for name, size in inputs.items():
        assert totals["by_tensor"][name]["read"] >= size, name
    assert totals["by_tensor"]["out"]["written"] == out_bytes
    assert totals["dram_read"] >= sum(inputs.values())


def test_prefill_counters(_corpora):
    B, H, Hkv, L, S, D = 1, 2, 1, 40, 70, 128
    case = cc.Case("prefill", "t", torch.float16, dict(B=B, H=H, Hkv=Hkv, L=L, S=S, D=D,
                                                       causal=False))  # fmt: skip
    sides = _sides(case)
    assert set(sides) == {
        "steel",
        "PyTorch prefill",
        "MLX steel_attention",
        "llama.cpp flash_attn_ext",
    }
    kv_bytes = _nbytes((B, Hkv, S, D), torch.float16)
    # (BQ, BK): steel's STEEL_ATTN_BQ and steel_attn_bk (shaders/steel/params.h: separate K and
    # V tiles of 32 keys fit the 20 KB budget at d128 f16); PyTorch's and MLX's host tiles for
    # head dim 128 (bq 32, bk 16); ggml's 8 queries per threadgroup and 64 keys per simdgroup
    # step.
    tiles = {"steel": (32, 32), "PyTorch prefill": (32, 16), "MLX steel_attention": (32, 16),
             "llama.cpp flash_attn_ext": (8, 64)}  # fmt: skip
    for label, (_, t) in sides.items():
        bq, bk = tiles[label]
        # Key fragments of 8 keys the products run on, per block of BQ rows: every tile's
        # BK / 8, except steel's, which skips the fragments past S on the last tile (forward.h,
        # attn_visible_frags): ceil(S / 8) of them.
        frags = math.ceil(S / 8) if label == "steel" else math.ceil(S / bk) * (bk // 8)
        blocks = B * H * math.ceil(L / bq)
        assert t["mma"] == blocks * frags * 2 * (bq // 8) * (D // 8), label
        # llama.cpp: float32 Q and result (ggml's types); the others the call's float16.
        qdt = torch.float32 if label.startswith("llama") else torch.float16
        inputs = {"q": _nbytes((B, H, L, D), qdt), "k": kv_bytes, "v": kv_bytes}
        _check_compulsory(t, inputs, _nbytes((B, H, L, D), qdt))
        # Each of the B * H * ceil(L / BQ) threadgroups reads its KV head's S rows of K.
        groups = B * H * math.ceil(L / bq)
        rows = groups * S
        if label.startswith("llama"):
            # Only the whole 64-key blocks come from K; the pad kernel copies the last S % 64
            # rows of each KV head once into its scratch, which the attention kernel reads.
            rows = groups * (S // bk) * bk + B * Hkv * (S % bk)
        assert t["by_tensor"]["k"]["read"] == rows * D * 2, label
        assert t["by_tensor"]["v"]["read"] == rows * D * 2, label


def test_decode_counters(_corpora):
    B, H, Hkv, L, S, D = 1, 4, 2, 1, 100, 128
    case = cc.Case("decode", "t", torch.float16, dict(B=B, H=H, Hkv=Hkv, L=L, S=S, D=D,
                                                      causal=False))  # fmt: skip
    sides = _sides(case)
    assert set(sides) == {
        "steel",
        "PyTorch sdpa_vector",
        "MLX sdpa_vector",
        "llama.cpp flash_attn_ext",
    }
    kv_bytes = _nbytes((B, Hkv, S, D), torch.float16)
    for label, (_, t) in sides.items():
        # llama.cpp: float32 Q and result (ggml's types); the others the call's float16.
        qdt = torch.float32 if label.startswith("llama") else torch.float16
        q_bytes = _nbytes((B, H, L, D), qdt)
        _check_compulsory(t, {"q": q_bytes, "k": kv_bytes, "v": kv_bytes}, q_bytes)
    # steel packs a KV head's query heads into threadgroups (docs/attention.md, Decode): K and V are
    # read once per threadgroup of a KV head's heads, once per KV head at the full packing; at so
    # few keys the planner packs fewer heads a threadgroup to fill the cores, and reads them group /
    # heads_per_tg times (decode_plan.cpp decode_layout_time). The one-pass sdpa_vector kernels
    # (PyTorch's is MLX's, adapted) run a threadgroup per (query head, query row), each reading its
    # KV head's keys once, and multiply no simdgroup matrices. llama.cpp's vector kernel (one query
    # a threadgroup here) reads the whole 32-key blocks from K once per query head and row; its pad
    # kernel copies the last S % 32 rows of each KV head once into the scratch that the kernel reads
    # instead.
    steel = sides["steel"][1]
    chunks = sides["steel"][0][0]["grid"][1] // Hkv  # the grid's y: KV heads x threadgroups
    assert 1 <= chunks <= H // Hkv
    assert steel["by_tensor"]["k"]["read"] == kv_bytes * chunks
    assert steel["by_tensor"]["v"]["read"] == kv_bytes * chunks
    for label in ("PyTorch sdpa_vector", "MLX sdpa_vector"):
        t = sides[label][1]
        assert t["by_tensor"]["k"]["read"] == kv_bytes * (H // Hkv) * L, label
        assert t["by_tensor"]["v"]["read"] == kv_bytes * (H // Hkv) * L, label
        assert t["mma"] == 0, label
    llama = sides["llama.cpp flash_attn_ext"][1]
    rows = B * H * L * (S // 32) * 32 + B * Hkv * (S % 32)
    assert llama["by_tensor"]["k"]["read"] == rows * D * 2
    assert llama["by_tensor"]["v"]["read"] == rows * D * 2


def test_gemm_counters(_corpora):
    M, N, K = 40, 33, 50
    case = cc.Case("gemm", "t", torch.float16, dict(M=M, N=N, K=K, b_transposed=True))
    sides = _sides(case)
    assert set(sides) == {"steel", "MLX steel_gemm_fused"}
    a_bytes, b_bytes = _nbytes((M, K), torch.float16), _nbytes((K, N), torch.float16)
    for label, (dispatches, t) in sides.items():
        (d,) = dispatches
        # The tile the kernel is instantiated with, from its host name.
        bm, bn, bk = (
            int(re.search(rf"_{x}(\d+)", d["kernel"]).group(1)) for x in ("bm", "bn", "bk")
        )
        tiles_m, tiles_n = math.ceil(M / bm), math.ceil(N / bn)
        assert math.prod(d["grid"]) == tiles_m * tiles_n, label
        steps = math.ceil(K / bk)
        assert t["mma"] == tiles_m * tiles_n * steps * (bm // 8) * (bn // 8) * (bk // 8), label
        # A's rows of a tile row are read by each of the tiles_n threadgroups along N, B's
        # columns by each of the tiles_m along M.
        extra_a = extra_b = 0
        if label.startswith("MLX"):
            # MLX's BlockLoader::load_safe (the ragged last K step) reads, for each element of
            # a thread's vector past K, the vector's first element instead (`src[tmp_idx[j] ?
            # i * src_ld + j : 0]`): (-K % BK) % vec re-read per row of the straddling thread,
            # vec = rows * BK / threads elements (both operands are loaded along K here: A is
            # "n", B "t", tiles of BM and BN rows).
            threads = math.prod(d["threads"])
            vec_a, vec_b = bm * bk // threads, bn * bk // threads
            extra_a = M * tiles_n * ((-(K % bk)) % vec_a) * 2
            extra_b = N * tiles_m * ((-(K % bk)) % vec_b) * 2
        assert t["by_tensor"]["a"]["read"] == a_bytes * tiles_n + extra_a, label
        assert t["by_tensor"]["b"]["read"] == b_bytes * tiles_m + extra_b, label
        _check_compulsory(t, {"a": a_bytes, "b": b_bytes}, _nbytes((M, N), torch.float16))


def test_unfetchable_corpus_is_skipped_with_its_reason(monkeypatch):
    """Offline: the foreign side is reported skipped, naming why, and steel's side still runs."""

    def offline():
        raise corpora.CorpusUnavailable("mlx-metal==0.32.4: pip download failed (offline?)")

    monkeypatch.setattr(mlx_metal, "include_dir", offline)
    case = cc.Case("gemm", "t", torch.float32, dict(M=16, N=16, K=8, b_transposed=False))
    result = cc.compare(case, (CHIP,), cache=False)
    assert [s["label"] for s in result["sides"]] == ["steel"]
    assert result["skipped"] == [("MLX steel_gemm_fused", "mlx-metal==0.32.4: pip download "
                                  "failed (offline?)")]  # fmt: skip
    assert "MLX steel_gemm_fused: skipped (mlx-metal==0.32.4" in cc.table(result, (CHIP,))
