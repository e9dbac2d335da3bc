"""torch_steel.patch(): routing of F.scaled_dot_product_attention, idempotence, restoring."""

import threading

import pytest
import torch
import torch.nn.functional as F

import torch_steel
from torch_steel import patching

ORIGINAL = F.scaled_dot_product_attention


@pytest.fixture
def calls(monkeypatch):
    """Records the calls that reach steel's sdpa through the patch."""
    seen = []
    real = patching.ops.sdpa

    def spy(*args, **kwargs):
        seen.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(patching.ops, "sdpa", spy)
    return seen


def test_patch_round_trip():
    assert not torch_steel.is_patched()
    torch_steel.patch()
    torch_steel.patch()  # idempotent: the original is not lost
    assert torch_steel.is_patched() and F.scaled_dot_product_attention is not ORIGINAL
    torch_steel.unpatch()
    assert F.scaled_dot_product_attention is ORIGINAL
    torch_steel.unpatch()  # no-op when not patched
    assert F.scaled_dot_product_attention is ORIGINAL


def test_patch_context_manager_restores_previous_state():
    with torch_steel.patch():
        assert torch_steel.is_patched()
        with torch_steel.patch():
            assert torch_steel.is_patched()
        assert torch_steel.is_patched()  # the inner block found it patched: stays patched
    assert F.scaled_dot_product_attention is ORIGINAL


def test_cpu_calls_under_auto_run_pytorchs_function(calls):
    q = torch.randn(1, 2, 4, 8)
    with torch_steel.patch():
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert calls == []
    torch.testing.assert_close(out, ORIGINAL(q, q, q, is_causal=True))


def test_reference_backend_routes_cpu_calls_to_steel(calls):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    mask = torch.rand(5, 7) > 0.5
    with torch_steel.backend("reference"), torch_steel.patch():
        out = F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, scale=0.2)
    assert calls == [q.shape]
    # steel and PyTorch both compute in float32 on these inputs.
    expected = ORIGINAL(q, k, v, mask, enable_gqa=True, scale=0.2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_calls_steel_cannot_serve_go_to_pytorch(calls):
    q = torch.randn(1, 2, 3, 4)
    with torch_steel.backend("reference"), torch_steel.patch():
        with pytest.raises(RuntimeError):  # PyTorch's own error for mismatched head dims
            F.scaled_dot_product_attention(q, torch.randn(1, 2, 3, 5), q)
    assert calls == []


def test_learned_bias_trains_under_patch(calls):
    q = torch.randn(1, 2, 3, 4)
    learned_bias = torch.randn(3, 3, requires_grad=True)
    with torch_steel.backend("reference"), torch_steel.patch():
        F.scaled_dot_product_attention(q, q, q, learned_bias).sum().backward()
    assert calls == [q.shape]
    expected = torch.zeros(3, 3, requires_grad=True)
    ORIGINAL(q, q, q, expected + learned_bias.detach()).sum().backward()
    torch.testing.assert_close(learned_bias.grad, expected.grad, atol=1e-5, rtol=1e-5)


def test_transformer_layer_under_patch_matches(calls, monkeypatch):
    # The fused inference fast path bypasses F.scaled_dot_product_attention: turn it off.
    monkeypatch.setattr(torch.backends.mha, "get_fastpath_enabled", lambda: False)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 6, 16)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(6)
    with torch.no_grad():
        expected = layer(x, src_mask=mask, is_causal=True)
        with torch_steel.backend("reference"), torch_steel.patch():
            got = layer(x, src_mask=mask, is_causal=True)
    assert calls, "the layer did not reach steel"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_patch_is_thread_safe():
    barrier = threading.Barrier(8)

    def flip():
        barrier.wait()
        for _ in range(50):
            torch_steel.patch()
            torch_steel.unpatch()

    threads = [threading.Thread(target=flip) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert F.scaled_dot_product_attention is ORIGINAL
    torch_steel.patch()
    assert torch_steel.is_patched()
