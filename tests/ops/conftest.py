import pytest
import torch

import torch_steel


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    """Each test starts from the default backend ("auto": reference math on CPU), not strict,
    with a fixed seed, and leaves steel inactive as F.scaled_dot_product_attention's provider."""
    monkeypatch.delenv("TORCH_STEEL_BACKEND", raising=False)
    monkeypatch.delenv("TORCH_STEEL_STRICT", raising=False)
    monkeypatch.delenv("TORCH_STEEL_PATCH_DEVICES", raising=False)
    torch.manual_seed(0)
    yield
    torch_steel.unpatch()


@pytest.fixture
def steel_calls(monkeypatch):
    """Records which reference attention functions ran ("forward", "backward", "varlen_forward",
    "varlen_backward"): on the "reference" and "sim" backends every steel attention call ends
    in one of them (the simulator's attention plans are refused today), PyTorch's never does."""
    from torch_steel import reference

    seen = []
    for name, label in (
        ("sdpa_forward", "forward"),
        ("sdpa_backward", "backward"),
        ("sdpa_varlen_forward", "varlen_forward"),
        ("sdpa_varlen_backward", "varlen_backward"),
    ):
        real = getattr(reference, name)

        def spy(*args, _real=real, _label=label, **kwargs):
            seen.append(_label)
            return _real(*args, **kwargs)

        monkeypatch.setattr(reference, name, spy)
    return seen
