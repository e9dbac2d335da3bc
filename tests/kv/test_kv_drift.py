"""bench/bench_kv_model.py's end-to-end drift, on a minimal tiny Llama (GQA, head dim 64, float32,
8 + 8 tokens): finite, larger for 4-bit than for int8 of the same group, and, at the first
position, independent of the key format."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_kv_model  # noqa: E402


def test_drift_per_format():
    model = bench_kv_model.tiny_llama(2, heads=4, head_dim=64, hidden=64, vocab=97,
                                      dtype=torch.float32)  # fmt: skip
    prompt = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(1))
    formats = ["int8_g64", "q4_g64", "q4_g32"]
    base, rows = bench_kv_model.drift(model, prompt, 8, formats, ["int8_g64", "q4_g64", "int8_g64"])
    assert base.shape == (15, 97) and torch.isfinite(base).all()
    int8, q4, q4_keys = (rows[p] for p in zip(formats, ["int8_g64", "q4_g64", "int8_g64"]))
    for r in (int8, q4, q4_keys):
        assert torch.isfinite(r["logits"]).all() and r["max_abs"] > 0
        assert 0 <= r["top1"] <= 1 and 0 <= r["free_run"] <= 8
    # 4-bit's step is ~17x int8's: its drift is larger, by more than rounding noise
    assert q4["max_abs"] > 3 * int8["max_abs"] and q4["rel_range"] > 3 * int8["rel_range"]
    # The first query sees only the first key (softmax weight 1 for any key): the same values
    # give the same first logits whatever the keys' format, while they differ later.
    assert torch.equal(q4_keys["logits"][0], int8["logits"][0])
    assert not torch.equal(q4_keys["logits"][1:], int8["logits"][1:])
    assert not torch.equal(q4["logits"][0], int8["logits"][0])  # the values' format shows
