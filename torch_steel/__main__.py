"""python -m torch_steel: which backend serves each op here, and a short self-check.

The self-check runs sdpa (forward and backward) and gemm on the best backend available (Metal
on MPS, else the CPU Metal simulator, else reference math) and prints the largest error against
the float64 reference. Exit status 1 when an error exceeds its tolerance.
"""

import sys
import warnings

import torch

import torch_steel
from torch_steel import backends
from torch_steel import reference as ref

OPS = ("sdpa", "sdpa_backward", "sdpa_varlen", "sdpa_varlen_backward", "gemm")
# float32 kernels against float64 math on O(1) data: a few hundred ulps of float32 at most.
TOLERANCE = 1e-4


def _best_backend():
    metal_ok, metal_why = backends.metal_status()
    if metal_ok:
        return "metal", torch.device("mps"), []
    sim_ok, sim_why = backends.sim_status()
    notes = [f"metal: {metal_why}"]
    if sim_ok:
        return "sim", torch.device("cpu"), notes
    return "reference", torch.device("cpu"), [*notes, f"sim: {sim_why}"]


def _max_err(a, b):
    return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()


def _check_sdpa(device):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 33, 64, dtype=torch.float64)
    k = torch.randn(2, 2, 47, 64, dtype=torch.float64)
    v = torch.randn(2, 2, 47, 64, dtype=torch.float64)
    grad = torch.randn(2, 4, 33, 64, dtype=torch.float64)
    kwargs = {"is_causal": True, "causal_align": "bottom_right", "enable_gqa": True}
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch_steel.backend("reference"):
        expected = torch_steel.sdpa(*inputs, **kwargs)
        expected_grads = torch.autograd.grad(expected, inputs, grad)
    inputs = [t.float().to(device).requires_grad_() for t in (q, k, v)]
    out = torch_steel.sdpa(*inputs, **kwargs)
    grads = torch.autograd.grad(out, inputs, grad.float().to(device))
    backward = max(_max_err(g, e) for g, e in zip(grads, expected_grads))
    return [("sdpa forward", _max_err(out, expected)), ("sdpa backward", backward)]


def _check_varlen(device):
    torch.manual_seed(2)
    cu = torch.tensor([0, 5, 17, 30], dtype=torch.int32)
    q, k, v = (torch.randn(30, 4, 32, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(30, 4, 32, dtype=torch.float64)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch_steel.backend("reference"):
        expected = torch_steel.sdpa_varlen(*inputs, cu, cu, 13, 13, is_causal=True)
        expected_grads = torch.autograd.grad(expected, inputs, grad)
    inputs = [t.float().to(device).requires_grad_() for t in (q, k, v)]
    cu = cu.to(device)
    out = torch_steel.sdpa_varlen(*inputs, cu, cu, 13, 13, is_causal=True)
    grads = torch.autograd.grad(out, inputs, grad.float().to(device))
    backward = max(_max_err(g, e) for g, e in zip(grads, expected_grads))
    return [("sdpa_varlen forward", _max_err(out, expected)), ("sdpa_varlen backward", backward)]


def _check_gemm(device):
    torch.manual_seed(1)
    a = torch.randn(3, 100, 72, dtype=torch.float64)
    b = torch.randn(72, 56, dtype=torch.float64)
    bias = torch.randn(56, dtype=torch.float64)
    expected = ref.gemm(a, b, bias, None, 0.125, 0.0, "gelu")
    out = torch_steel.gemm(
        a.float().to(device),
        b.float().to(device),
        bias=bias.float().to(device),
        alpha=0.125,
        activation="gelu",
    )
    return [("gemm (float32, gelu epilogue)", _max_err(out, expected))]


def main():
    name, device, notes = _best_backend()
    print(f"torch-steel {torch_steel.__version__}, torch {torch.__version__}")
    print(f"best backend here: {name} ({device.type} tensors)")
    for note in notes:
        print(f"  not used: {note}")
    with torch_steel.backend(name), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", torch_steel.FallbackWarning)
        results = _check_sdpa(device) + _check_varlen(device) + _check_gemm(device)
    fell_back = {
        w.message.op: w.message.reason
        for w in caught
        if issubclass(w.category, torch_steel.FallbackWarning)
    }
    print("which backend served each op:")
    for op in OPS:
        served = "reference" if name == "reference" or op in fell_back else name
        why = f" (fallback: {fell_back[op]})" if op in fell_back else ""
        print(f"  steel::{op:<22} -> {served}{why}")
    print(f"max abs error against the float64 reference (tolerance {TOLERANCE:g}):")
    ok = True
    for label, err in results:
        good = err <= TOLERANCE
        ok &= good
        print(f"  {label:<32} {err:.3e}  {'ok' if good else 'FAILED'}")
    print("self-check passed" if ok else "self-check FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
