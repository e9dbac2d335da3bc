"""Backend selection, the one-time fallback warning, strict mode, and the simulator path."""

import warnings

import pytest
import torch

import torch_steel
from torch_steel import backends
from torch_steel.errors import PlanRefused

SIM_OK, SIM_WHY = backends.sim_status()
needs_sim = pytest.mark.skipif(not SIM_OK, reason=f"simulator not available: {SIM_WHY}")


def test_backend_context_and_environment(monkeypatch):
    assert torch_steel.current_backend() == "auto"
    monkeypatch.setenv("TORCH_STEEL_BACKEND", "reference")
    assert torch_steel.current_backend() == "reference"
    with torch_steel.backend("sim"):
        assert torch_steel.current_backend() == "sim"
        with torch_steel.backend("auto"):
            assert torch_steel.current_backend() == "auto"
        assert torch_steel.current_backend() == "sim"
    assert torch_steel.current_backend() == "reference"
    with pytest.raises(ValueError, match="unknown torch_steel backend 'cuda'"):
        with torch_steel.backend("cuda"):
            pass
    monkeypatch.setenv("TORCH_STEEL_BACKEND", "gpu")
    with pytest.raises(ValueError, match="TORCH_STEEL_BACKEND='gpu'"):
        torch_steel.current_backend()


def test_metal_backend_needs_mps_tensors():
    with torch_steel.backend("metal"), pytest.raises(RuntimeError, match="needs MPS tensors"):
        torch_steel.gemm(torch.randn(2, 2), torch.randn(2, 2))


def test_sim_backend_unavailable_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(backends, "sim_status", lambda: (False, "no clang-19 here"))
    with torch_steel.backend("sim"), pytest.raises(NotImplementedError, match="no clang-19 here"):
        torch_steel.gemm(torch.randn(2, 2), torch.randn(2, 2))


@pytest.fixture
def refusing_sim(monkeypatch):
    """A simulator whose every plan is refused, to exercise the fallback logic alone."""
    from torch_steel import sim

    calls = []

    def run_op(op, tensors, options):
        calls.append((op, options))
        raise PlanRefused(f"test refusal of {op}")

    monkeypatch.setattr(backends, "sim_status", lambda: (True, ""))
    monkeypatch.setattr(sim, "run_op", run_op)
    monkeypatch.setattr(backends, "_warned", set())
    return calls


def test_refused_plan_warns_once_and_falls_back(refusing_sim):
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with torch_steel.backend("sim"):
        with pytest.warns(torch_steel.FallbackWarning, match="test refusal of gemm"):
            out = torch_steel.gemm(a, b, alpha=2.0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the second refusal of the same reason is silent
            torch_steel.gemm(a, b)
    torch.testing.assert_close(out, 2.0 * a @ b)
    assert refusing_sim[0] == ("gemm", {"alpha": 2.0, "beta": 0.0, "activation": "none"})


def test_strict_mode_turns_refusal_into_error(refusing_sim, monkeypatch):
    monkeypatch.setenv("TORCH_STEEL_STRICT", "1")
    with torch_steel.backend("sim"), pytest.raises(PlanRefused, match="TORCH_STEEL_STRICT"):
        torch_steel.gemm(torch.randn(3, 4), torch.randn(4, 5))


def test_backward_runs_on_the_forward_backend(refusing_sim):
    q, k, v = (torch.randn(1, 2, 3, 4, requires_grad=True) for _ in range(3))
    with torch_steel.backend("sim"), pytest.warns(torch_steel.FallbackWarning):
        out = torch_steel.sdpa(q, k, v, is_causal=True)
    with pytest.warns(torch_steel.FallbackWarning, match="sdpa_backward"):
        out.sum().backward()  # outside the `with`: the backend was captured at forward time
    ops = [op for op, _ in refusing_sim]
    assert ops == ["sdpa", "sdpa_backward"]
    options = refusing_sim[0][1]
    assert options["is_causal"] is True and options["scale"] == pytest.approx(0.5)


@needs_sim
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_gemm_on_sim_matches_reference(dtype, tol):
    """The shipped GEMM kernel run in the simulator against float64 math.

    fp32 accumulation over K = 40: ~1e-6 relative for float32; fp16 adds one output rounding.
    """
    a, b = torch.randn(2, 19, 40).to(dtype), torch.randn(40, 13).to(dtype)
    bias, c = torch.randn(13).to(dtype), torch.randn(19, 13).to(dtype)
    with torch_steel.backend("sim"), warnings.catch_warnings():
        warnings.simplefilter("error", torch_steel.FallbackWarning)  # must not fall back
        out = torch_steel.gemm(a, b, bias=bias, c=c, alpha=0.5, beta=2.0, activation="gelu")
    z = 0.5 * (a.double() @ b.double()) + 2.0 * c.double() + bias.double()
    torch.testing.assert_close(out.double(), torch.nn.functional.gelu(z), rtol=tol, atol=tol)


@needs_sim
def test_sdpa_on_sim_is_served_or_refused_with_reason(monkeypatch):
    """Until attention kernels exist, their plan is refused: reference math, and a warning."""
    monkeypatch.setattr(backends, "_warned", set())
    q = torch.randn(1, 2, 3, 8)
    with torch_steel.backend("sim"), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = torch_steel.sdpa(q, q, q)
    fallbacks = [w for w in record if issubclass(w.category, torch_steel.FallbackWarning)]
    assert all("plan refused" in str(w.message) for w in fallbacks)
    # fp32 kernel or reference vs PyTorch's fp32 math: a few ulps of O(1) values.
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture
def pretend_mps(monkeypatch):
    """Routes CPU tensors as if they were MPS tensors, to exercise the Metal-path decisions here
    (the Metal host's own tests run the real thing on a Mac)."""
    monkeypatch.setattr(backends, "_device_type", lambda tensors: "mps")
    monkeypatch.setattr(backends, "_warned", set())


def test_metal_refusal_falls_back(pretend_mps, monkeypatch):
    from torch_steel import metal

    def run_op(op, tensors, options):
        raise PlanRefused("dtype float64 is not supported")

    monkeypatch.setattr(backends, "metal_status", lambda: (True, ""))
    monkeypatch.setattr(metal, "run_op", run_op)
    a, b = torch.randn(2, 3, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    with pytest.warns(torch_steel.FallbackWarning, match="Metal plan refused: dtype float64"):
        out = torch_steel.gemm(a, b)
    torch.testing.assert_close(out, a @ b)


def test_metal_status_names_an_old_macos(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: major < 14)
    assert backends.metal_status() == (False, "the kernels need macOS 14.0 or newer (Metal 3.1)")


def test_metal_unavailable(pretend_mps, monkeypatch):
    monkeypatch.setattr(backends, "metal_status", lambda: (False, "extension not built"))
    a = torch.randn(2, 2)
    with pytest.warns(torch_steel.FallbackWarning, match="extension not built"):
        torch_steel.gemm(a, a)  # auto: reference math, with the reason
    with torch_steel.backend("metal"), pytest.raises(RuntimeError, match="extension not built"):
        torch_steel.gemm(a, a)  # asked for Metal explicitly: an error
