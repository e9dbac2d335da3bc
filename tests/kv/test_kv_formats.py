"""torch_steel.kv: the quantized KV formats' layouts and round-trip error bounds, against float64
arithmetic written out here (not the module's own dequantize)."""

import pytest
import torch

from torch_steel import kv
from torch_steel.kv import QuantizedKV

FORMATS = list(kv.FORMATS)
SCALES = (torch.float16, torch.float32)
# Relative rounding of a stored scale or min: half an ulp of its dtype.
ULP = {torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def _data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    x[..., 0, :] = 0  # an all-zero row: scale 0 dequantizes to 0
    x[..., 1, 5] = 40  # an outlier inside one group
    return x.to(dtype)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("scale_dtype", SCALES)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32))
def test_round_trip_bound(format, scale_dtype, dtype):
    """|x - dequantize(quantize(x))| <= half a quantization step plus the stored scale's and
    min's rounding, per group, with the step and range computed here in float64."""
    E = 128
    x = _data((2, 3, 7, E), dtype, 1)
    q = kv.quantize(x, format, scale_dtype)
    bits, group = kv.FORMATS[format]
    G = group or E
    x64 = x.double().reshape(2, 3, 7, E // G, G)
    y = q.dequantize(torch.float64).reshape(x64.shape)
    err = (x64 - y).abs()
    u = ULP[scale_dtype]
    if bits == 8:
        step = x64.abs().amax(-1, keepdim=True) / 127
        # q = round(x / s~) with s~ = s (1 +- u): error s~/2, plus the clamp at 127 losing
        # at most 127 s u of the largest value.
        bound = step * (0.5 + 128 * u)
    else:
        lo, hi = x64.amin(-1, keepdim=True), x64.amax(-1, keepdim=True)
        step = (hi - lo) / 15
        # half a step, the min's rounding (|lo| u), and 15 steps of the scale's rounding
        # (which also bears the min's rounding, divided by 15)
        bound = step * (0.5 + 16 * u) + 2 * lo.abs() * u
    assert (err <= bound + 1e-12).all(), (err - bound).max()
    assert (y[0, 0, 0] == 0).all()  # the all-zero row
    assert q.scales.dtype == scale_dtype and q.shape == x.shape


def test_int8_layout():
    """int8 data is the row's codes in order, one scale per group, symmetric."""
    x = torch.arange(64, dtype=torch.float32).reshape(1, 64) - 32  # -32 .. 31
    q = kv.quantize(x, "int8_g32", torch.float32)
    assert q.data.dtype == torch.int8 and q.data.shape == (1, 64)
    assert q.scales.shape == (1, 2) and q.mins is None
    torch.testing.assert_close(q.scales, torch.tensor([[32 / 127, 31 / 127]]))
    expect = torch.cat([(x[0, :32] * 127 / 32).round(), (x[0, 32:] * 127 / 31).round()])
    assert torch.equal(q.data[0].to(torch.float32), expect)
    per_row = kv.quantize(x, "int8", torch.float16)
    assert per_row.scales.shape == (1, 1)


def test_q4_layout():
    """Byte j holds element 2j in its low nibble and 2j + 1 in its high one; codes 0..15 of a
    group spanning [min, min + 15 s]."""
    x = torch.cat([torch.arange(16.0), torch.arange(16.0).flip(0)]) * 0.5 - 1  # one group of 32
    q = kv.quantize(x.reshape(1, 32), "q4_g32", torch.float32)
    assert q.data.dtype == torch.uint8 and q.data.shape == (1, 16)
    assert q.scales.item() == 0.5 and q.mins.item() == -1
    codes = [int(v) for v in torch.cat([torch.arange(16), torch.arange(16).flip(0)])]
    expect = [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]
    assert q.data[0].tolist() == expect
    assert q.data[0, 0].item() == 0x10  # elements 0 (low) and 1 (high)


@pytest.mark.parametrize("format", ("int8_g64", "q4_g32"))
def test_append_one_token_at_a_time(format):
    """A preallocated cache filled one token (and then several) at a time equals quantizing
    the whole tensor at once, and the returned view covers the tokens written."""
    x = _data((2, 4, 9, 64), torch.float16, 2)
    cache = QuantizedKV.empty((2, 4, 16, 64), format, torch.float16)
    for t in range(5):
        view = cache.append_(x[:, :, t : t + 1], t)
        assert view.shape == (2, 4, t + 1, 64)
    view = cache.append_(x[:, :, 5:], 5)
    whole = kv.quantize(x, format, torch.float16)
    assert torch.equal(view.data, whole.data) and torch.equal(view.scales, whole.scales)
    if whole.mins is not None:
        assert torch.equal(view.mins, whole.mins)
    assert (cache.data[:, :, 9:] == 0).all()  # untouched beyond the tokens written
    with pytest.raises(ValueError, match="do not fit"):
        cache.append_(x, 10)


def test_paged_write():
    """A paged pool [pages, page_size, H, E] written slot by slot through write_."""
    pool = QuantizedKV.empty((3, 4, 2, 32), "q4_g32", torch.float32)
    x = _data((2, 32), torch.float32, 3)
    pool.write_((2, 1), x)
    assert torch.equal(pool.data[2, 1], kv.quantize(x, "q4_g32", torch.float32).data)
    assert (pool.data[:2] == 0).all()


def test_bad_input_named():
    x = torch.randn(2, 48)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        kv.quantize(x, "int8_g32")
    with pytest.raises(ValueError, match="unknown KV format"):
        kv.quantize(x, "int4")
    q = kv.quantize(torch.randn(2, 64), "q4_g32")
    with pytest.raises(ValueError, match="scales must have shape"):
        QuantizedKV(q.data, q.scales[:, :1], q.mins[:, :1].clone(), "q4_g32")
    with pytest.raises(TypeError, match="needs mins"):
        QuantizedKV(q.data, q.scales, None, "q4_g32")
    with pytest.raises(TypeError, match="must be torch.int8"):
        QuantizedKV(q.data, q.scales, None, "int8_g32")
    with pytest.raises(TypeError, match="float16 or float32"):
        kv.quantize(x, "int8", torch.bfloat16)
