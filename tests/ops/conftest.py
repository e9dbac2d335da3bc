import pytest
import torch

import torch_steel


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    """Each test starts from the default backend ("auto": reference math on CPU), not strict,
    with a fixed seed, and leaves F.scaled_dot_product_attention unpatched."""
    monkeypatch.delenv("TORCH_STEEL_BACKEND", raising=False)
    monkeypatch.delenv("TORCH_STEEL_STRICT", raising=False)
    torch.manual_seed(0)
    yield
    torch_steel.unpatch()
