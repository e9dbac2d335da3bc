"""torch_steel.sdpa and sdpa_varlen with QuantizedKV key and value on the reference backend:
float64 attention (PyTorch's own F.scaled_dot_product_attention) over the dequantized cache is
the oracle, so only the fp16 path's tolerance separates them; opcheck and torch.compile of the
ops; the gradient refused with its reason."""

import math

import pytest
import torch
import torch.nn.functional as F

import torch_steel
from torch_steel import kv
from torch_steel.kv import QuantizedKV

# The same math as the fp16 path: the op dequantizes into the query's dtype (one rounding of
# each K/V value, as the kernels' loader will) and computes in float32; float64 over the exact
# dequantized values differs by those roundings.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}


def _x(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _oracle(q, kq, vq, **kw):
    k64, v64 = kq.dequantize(torch.float64), vq.dequantize(torch.float64)
    return F.scaled_dot_product_attention(q.double(), k64, v64, **kw)


@pytest.fixture(autouse=True)
def _reference():
    with torch_steel.backend("reference"):
        yield


PAIRS = [
    ("int8", "int8_g64"),
    ("int8_g32", "q4_g32"),
    ("q4_g64", "int8_g128"),
    ("q4_g32", "q4_g64"),
]


@pytest.mark.parametrize("k_format,v_format", PAIRS)
@pytest.mark.parametrize("dtype", list(TOL))
def test_sdpa_quantized_dense(k_format, v_format, dtype):
    """GQA decode and causal prefill over a quantized cache, scales fp16 for K, fp32 for V."""
    q = _x(2, 8, 5, 128, seed=1, dtype=dtype)
    kq = kv.quantize(_x(2, 2, 33, 128, seed=2), k_format, torch.float16)
    vq = kv.quantize(_x(2, 2, 33, 128, seed=3), v_format, torch.float32)
    for causal in (False, True):
        got = torch_steel.sdpa(q, kq, vq, is_causal=causal, enable_gqa=True,
                               causal_align="bottom_right")  # fmt: skip
        mask = torch.ones(5, 33, dtype=torch.bool).tril(33 - 5) if causal else None
        want = _oracle(q, kq, vq, attn_mask=mask, enable_gqa=True)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_sdpa_quantized_mha_mask_lse():
    """MHA with a float mask and the log-sum-exp, against float64 written out."""
    q = _x(1, 3, 4, 64, seed=4)
    kq = kv.quantize(_x(1, 3, 31, 64, seed=5), "int8_g64")
    vq = kv.quantize(_x(1, 3, 31, 64, seed=6), "q4_g64")
    mask = _x(4, 31, seed=7)
    out, lse = torch_steel.sdpa(q, kq, vq, mask, return_lse=True)
    s = q.double() @ kq.dequantize(torch.float64).mT / math.sqrt(64) + mask.double()
    torch.testing.assert_close(lse.double(), s.logsumexp(-1), atol=2e-5, rtol=2e-5)
    want = s.softmax(-1) @ vq.dequantize(torch.float64)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def _packed_oracle(q, k, v, cu_q, cu_k, dtype):
    out = []
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1).double()
        ks, vs = (t[cu_k[b] : cu_k[b + 1]].transpose(0, 1) for t in (k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
        out.append(o.transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_sdpa_varlen_quantized_packed_and_paged(dtype):
    """Ragged sequences (1, 31, 33 keys) packed, and the same keys in a paged pool written one
    token at a time through QuantizedKV.write_, give float64 attention over the dequantized
    keys."""
    lengths, H, Hk, E = [1, 31, 33], 4, 2, 64
    cu_k = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu_q = list(range(len(lengths) + 1))  # one query row per sequence (decode)
    q = _x(len(lengths), H, E, seed=8, dtype=dtype)
    k, v = _x(cu_k[-1], Hk, E, seed=9), _x(cu_k[-1], Hk, E, seed=10)
    kq, vq = kv.quantize(k, "int8_g32"), kv.quantize(v, "q4_g32")
    want = _packed_oracle(q, kq.dequantize(torch.float64), vq.dequantize(torch.float64), cu_q,
                          cu_k, dtype)  # fmt: skip
    i32 = dict(dtype=torch.int32)
    got = torch_steel.sdpa_varlen(q, kq, vq, torch.tensor(cu_q, **i32), torch.tensor(cu_k, **i32),
                                  1, max(lengths))  # fmt: skip
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])

    page = 16
    kp = QuantizedKV.empty((8, page, Hk, E), "int8_g32")
    vp = QuantizedKV.empty((8, page, Hk, E), "q4_g32")
    pages = torch.tensor([[5, 0, 0], [2, 7, 0], [1, 3, 6]], **i32)  # out of order, shared unused
    for b, n in enumerate(lengths):
        for j in range(n):
            slot = (int(pages[b, j // page]), j % page)
            kp.write_(slot, k[cu_k[b] + j])
            vp.write_(slot, v[cu_k[b] + j])
    used = torch.tensor(lengths, **i32)
    got = torch_steel.sdpa_varlen(q, kp, vp, torch.tensor(cu_q, **i32), None, 1, max(lengths),
                                  block_table=pages, seqused_k=used)  # fmt: skip
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def _op_args():
    q = _x(1, 4, 3, 64, seed=11)
    kq = kv.quantize(_x(1, 2, 7, 64, seed=12), "q4_g32")
    vq = kv.quantize(_x(1, 2, 7, 64, seed=13), "int8", torch.float32)
    return q, kq, vq


def test_opcheck():
    q, kq, vq = _op_args()
    args = (q, *kq.tensors(), *vq.tensors(), kq.format, vq.format, None, 0.0, True, 0.125)
    torch.library.opcheck(torch.ops.steel.sdpa_quantized_forward, args)
    qp = _x(3, 4, 64, seed=14)
    kp = kv.quantize(_x(2, 4, 2, 64, seed=15), "int8_g64")
    vp = kv.quantize(_x(2, 4, 2, 64, seed=16), "q4_g64")
    i32 = dict(dtype=torch.int32)
    paged = (torch.tensor([0, 1, 3], **i32), None, torch.tensor([[1, 0], [0, 1]], **i32),
             torch.tensor([3, 8], **i32), 2, 8)  # fmt: skip
    options = (0.0, True, 0.125, None, 0.0, -1, -1, True, 0, 0, 0)
    torch.library.opcheck(
        torch.ops.steel.sdpa_varlen_quantized_forward,
        (qp, *kp.tensors(), *vp.tensors(), kp.format, vp.format, *paged, *options),
    )


def test_compile_traces_quantized_kv():
    """torch.compile(fullgraph=True) traces a call taking QuantizedKV (the container is
    unpacked into tensors and format strings at the op) and matches eager."""
    q, kq, vq = _op_args()

    def attend(q, k, v):
        return torch_steel.sdpa(q * 2, k, v, enable_gqa=True)

    want = attend(q, kq, vq)
    got = torch.compile(attend, fullgraph=True, backend="aot_eager")(q, kq, vq)
    torch.testing.assert_close(got, want)


def test_gradient_refused_with_reason():
    q, kq, vq = _op_args()
    q.requires_grad_()
    with pytest.raises(RuntimeError, match="inference only"):
        torch_steel.sdpa(q, kq, vq, enable_gqa=True)
    args = (q, *kq.tensors(), *vq.tensors(), kq.format, vq.format, None, 0.0, False, 0.125)
    with pytest.raises(RuntimeError, match="no gradient .quantized K/V are inference only"):
        torch.ops.steel.sdpa_quantized_forward(*args)
    with torch.no_grad():
        torch_steel.sdpa(q, kq, vq, enable_gqa=True)


def test_bad_input_named():
    q, kq, vq = _op_args()
    with pytest.raises(TypeError, match="both be QuantizedKV or both be tensors"):
        torch_steel.sdpa(q, kq, vq.dequantize(), enable_gqa=True)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        torch_steel.sdpa(q, kq, vq)
    with pytest.raises(ValueError, match="head dims"):
        torch_steel.sdpa(q[..., :32], kq, vq, enable_gqa=True)
    bad = kq.tensors()
    args = (q, bad[0], bad[1], None, *vq.tensors(), kq.format, vq.format, None, 0.0, False, 1.0)
    with pytest.raises(TypeError, match="key: q4_g32 needs mins"):
        torch.ops.steel.sdpa_quantized_forward(*args)
