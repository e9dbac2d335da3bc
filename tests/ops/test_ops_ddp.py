"""Scale-out stays PyTorch's: a two-process DistributedDataParallel step (gloo, CPU, a file
store, no network beyond the machine) over a model whose attention and projections are steel
ops gives the gradients of one process on the whole batch."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import torch_steel
from torch_steel import reference

CPU = ("mps", "cpu")
WORLD = 2


class TinyAttention(torch.nn.Module):
    """Self-attention through F.sdpa (served by steel under patch()) and steel.linear."""

    def __init__(self, dim=16, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, L, D = x.shape
        qkv = torch_steel.linear(x, self.qkv.weight, self.qkv.bias)
        q, k, v = qkv.view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        merged = y.transpose(1, 2).reshape(B, L, D)
        return torch_steel.linear(merged, self.out.weight, self.out.bias)


def _model():
    torch.manual_seed(0)
    return TinyAttention().double()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 6, 16, dtype=torch.float64, generator=g)


def _step(model, x):
    with torch_steel.backend("reference"), torch_steel.patch(devices=CPU):
        model(x).square().mean().backward()


def _worker(rank, store, result):
    # A bounded wait: a rank that never arrives fails the test instead of hanging the run.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        calls = []
        real = reference.sdpa_forward

        def spy(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        reference.sdpa_forward = spy
        model = torch.nn.parallel.DistributedDataParallel(_model())
        shard = _data().chunk(WORLD)[rank]
        _step(model, shard)
        if rank == 0:
            grads = {n: p.grad for n, p in model.module.named_parameters()}
            torch.save({"grads": grads, "steel_calls": len(calls)}, result)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # once seen waiting for its second process under a loaded 2-core CI run
def test_two_process_ddp_step_matches_one_process(tmp_path, monkeypatch):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    store, result = tmp_path / "store", tmp_path / "grads.pt"
    # The children find torch_steel and this module where the parent does.
    root = os.path.dirname(os.path.dirname(torch_steel.__file__))
    paths = [p for p in (root, os.environ.get("PYTHONPATH")) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    mp.spawn(_worker, args=(str(store), str(result)), nprocs=WORLD, join=True)
    got = torch.load(result)
    assert got["steel_calls"] == 1

    model = _model()
    _step(model, _data())
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad, msg=name)
