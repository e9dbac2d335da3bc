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
    """Records which steel attention ops ran ("forward", "backward", "varlen_forward",
    "varlen_backward"), whichever backend served them (reference math, the simulated kernels,
    or a refused plan's fallback): every steel attention call goes through
    torch_steel.backends.run once, PyTorch's own attention never does."""
    from torch_steel.ops import attention_ops, varlen_ops

    labels = {
        "sdpa": "forward",
        "sdpa_backward": "backward",
        "sdpa_varlen": "varlen_forward",
        "sdpa_varlen_backward": "varlen_backward",
    }
    seen = []
    real = attention_ops.run  # backends.run, which both families call

    def spy(op, *args, **kwargs):
        if op in labels:
            seen.append(labels[op])
        return real(op, *args, **kwargs)

    monkeypatch.setattr(attention_ops, "run", spy)
    monkeypatch.setattr(varlen_ops, "run", spy)
    return seen
