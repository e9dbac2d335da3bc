"""steel::gemm and torch_steel.linear against torch.matmul plus the epilogue."""

import pytest
import torch
import torch.nn.functional as F

import torch_steel

EPILOGUES = {
    "none": lambda z: z,
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}


def _oracle(a, b, bias=None, c=None, alpha=1.0, beta=0.0, activation="none"):
    z = alpha * torch.matmul(a.double(), b.double())
    if c is not None and beta != 0:
        z = z + beta * c.double()
    if bias is not None:
        z = z + bias.double()
    return EPILOGUES[activation](z)


@pytest.mark.parametrize("activation", list(EPILOGUES))
def test_gemm_epilogues(activation):
    a, b = torch.randn(2, 5, 7, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    bias, c = torch.randn(3, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)
    out = torch_steel.gemm(a, b, bias=bias, c=c, alpha=0.5, beta=-2.0, activation=activation)
    expected = _oracle(a, b, bias, c, 0.5, -2.0, activation)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(
    "a_shape,b_shape",
    [((4, 6), (6, 5)), ((3, 1, 4, 6), (2, 6, 5)), ((4, 6), (3, 6, 5)), ((2, 1, 6), (2, 6, 1))],
)
def test_gemm_batch_broadcast_like_matmul(a_shape, b_shape):
    a, b = torch.randn(a_shape, dtype=torch.float64), torch.randn(b_shape, dtype=torch.float64)
    torch.testing.assert_close(torch_steel.gemm(a, b), torch.matmul(a, b), atol=1e-12, rtol=0)


def test_gemm_transposed_and_offset_operands():
    base = torch.randn(3, 9, 8, dtype=torch.float64)
    a = base[:, 1:, :6].mT  # [3, 6, 8] with strides from a transpose and a storage offset
    b = torch.randn(5, 8, dtype=torch.float64).t()
    torch.testing.assert_close(torch_steel.gemm(a, b), a @ b, atol=1e-12, rtol=0)


def test_gemm_beta_zero_ignores_c():
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    c = torch.full((3, 2), float("nan"))
    torch.testing.assert_close(torch_steel.gemm(a, b, c=c, beta=0.0), a @ b)


@pytest.mark.parametrize(
    "dtype,tol",
    [
        # fp32 accumulation over K = 64 of O(1) products: ~1e-6 relative.
        (torch.float32, 1e-5),
        # fp32 accumulation then one rounding of the output: half an fp16/bf16 ulp.
        (torch.float16, 1e-3),
        (torch.bfloat16, 8e-3),
    ],
)
def test_gemm_low_precision(dtype, tol):
    a, b, bias = torch.randn(17, 64), torch.randn(64, 9), torch.randn(9)
    a, b, bias = a.to(dtype), b.to(dtype), bias.to(dtype)
    out = torch_steel.gemm(a, b, bias=bias, activation="silu")
    assert out.dtype == dtype
    expected = _oracle(a, b, bias, activation="silu")
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("activation", list(EPILOGUES))
def test_gemm_gradcheck(activation):
    a = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    c = torch.randn(3, 1, dtype=torch.float64, requires_grad=True)

    def fn(a, b, bias, c):
        return torch_steel.gemm(a, b, bias=bias, c=c, alpha=1.5, beta=0.7, activation=activation)

    assert torch.autograd.gradcheck(fn, (a, b, bias, c))


def test_linear_matches_nn_linear():
    layer = torch.nn.Linear(6, 4).double()
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    out = torch_steel.linear(x, layer.weight, layer.bias, activation="gelu_tanh")
    expected = F.gelu(layer(x), approximate="tanh")
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.sum(), (x, layer.weight, layer.bias))
    expected_grads = torch.autograd.grad(expected.sum(), (x, layer.weight, layer.bias))
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e)
    assert torch_steel.linear(x[0, 0], layer.weight).shape == (4,)
