"""AttnQuantTileLoader (shaders/steel/attn/loader.h) in the simulator, checkers on: a K/V tile of
quantized codes (torch_steel.kv formats) dequantized into threadgroup memory in the compute
dtype equals float64 dequantization rounded once to that dtype, on dense and paged rows, ragged
rows and head dims, aligned (16-byte chunks) and unaligned code rows. The loader is not yet
wired into the attention kernels (issue 27): this pins its arithmetic and addressing first."""

import struct
from pathlib import Path

import pytest
import torch
from attn_helpers import requires_simulator

from torch_steel import kv

KERNELS = Path(__file__).parent / "kernels" / "attention_quant_loader.metal"
DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
ROWS = 16  # the test kernel's tile rows
# One rounding of a float32 dequantized value to the compute dtype (half an ulp), which the
# kernel's fused multiply-add may land on the other side of: one ulp.
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-22}


def _run(codes, scales, mins, fmt, dtype, cols, valid_rows, E, ld, scale_ld, vec,
         table=None, key0=0, page_size=1, page_stride=0, scale_page_stride=0, pages=1):  # fmt: skip
    from torch_steel import sim

    bits, group = kv.FORMATS[fmt]
    out = torch.full((ROWS, cols), float("nan"), dtype=dtype)
    params = struct.pack(
        "<4q10i", ld, scale_ld, page_stride, scale_page_stride, valid_rows, E, bits,
        group or E, int(scales.dtype == torch.float32), int(vec), int(table is not None), key0,
        page_size, pages,
    )  # fmt: skip
    table = torch.zeros(1, dtype=torch.int32) if table is None else table
    mins = scales if mins is None else mins  # bound, never read (int8)
    sim.run_kernel(f"quant_loader_{DTYPES[dtype]}_{cols}", sources=[KERNELS], grid=(1, 1, 1),
                   threads=(128, 1, 1), buffers={0: codes, 1: scales, 2: mins, 3: out,
                                                 4: params, 5: table}, checkers=True)  # fmt: skip
    return out


def _check(out, want, valid_rows, E, dtype):
    want = want.to(dtype).double()
    got = out.double()
    tol = ULP[dtype] * want.abs() + 1e-7 * want.abs().max()
    assert ((got[:valid_rows, :E] - want).abs() <= tol).all(), got[:valid_rows, :E] - want
    assert (got[valid_rows:] == 0).all() and (got[:, E:] == 0).all()  # zero fill


CASES = [("int8", 40, 40), ("int8", 128, 96), ("int8_g32", 128, 96), ("int8_g64", 128, 128),
         ("int8_g128", 128, 128), ("q4_g32", 128, 96), ("q4_g64", 128, 128)]  # fmt: skip


@requires_simulator
@pytest.mark.parametrize("fmt,cols,E", CASES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dense_rows(fmt, cols, E, dtype):
    """Rows of head 1 of a [S, H=2, E] cache (row stride 2 rows of codes), 13 of 16 rows valid;
    fp16 scales with 16-byte aligned rows (vector loads), fp32 scales with the codes 3 bytes
    into their buffer (byte loads)."""
    x = torch.randn(13, 2, E, generator=torch.Generator().manual_seed(E), dtype=torch.float64)
    for scale_dtype, offset in ((torch.float16, 0), (torch.float32, 3)):
        q = kv.quantize(x, fmt, scale_dtype)
        width = q.data.shape[-1]
        flat = torch.zeros(offset + q.data.numel(), dtype=torch.uint8)
        flat[offset:] = q.data.reshape(-1).view(torch.uint8)
        codes = flat[offset + width :]  # head 1
        scales, n = q.scales.reshape(-1), q.scales.shape[-1]
        mins = None if q.mins is None else q.mins.reshape(-1)[n:]
        vec = offset == 0 and width % 16 == 0
        out = _run(codes, scales[n:], mins, fmt, dtype, cols, 13, E, 2 * width, 2 * n, vec)
        _check(out, q.dequantize(torch.float64)[:, 1], 13, E, dtype)


@requires_simulator
@pytest.mark.parametrize("fmt", ["int8_g32", "q4_g64"])
def test_paged_rows(fmt):
    """Keys 2 .. 17 of a sequence in a pool [5 pages, 4 slots, H=2, 64] through the block table
    [3, 0, 4, 1, 2] (out of order), 14 keys valid: rows cross pages mid-tile."""
    E, page, H = 64, 4, 2
    x = torch.randn(5, page, H, E, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    q = kv.quantize(x, fmt, torch.float16)
    width, n = q.data.shape[-1], q.scales.shape[-1]
    table = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32)
    codes = q.data.reshape(-1).view(torch.uint8)
    mins = None if q.mins is None else q.mins.reshape(-1)
    out = _run(codes, q.scales.reshape(-1), mins, fmt, torch.float16, 128, 14, E, H * width,
               H * n, True, table=table, key0=2, page_size=page, page_stride=page * H * width,
               scale_page_stride=page * H * n, pages=5)  # fmt: skip
    keys = q.dequantize(torch.float64)[table.long()].reshape(-1, H, E)[2:16, 0]
    _check(out, keys, 14, E, torch.float16)
