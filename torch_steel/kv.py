"""Quantized KV caches: the formats, their reference quantize / dequantize, and a container.

A quantized key or value tensor of logical shape [..., E] (any leading dims: [B, H, S, E] for
torch_steel.sdpa, [total_k, H, E] for sdpa_varlen, a paged pool [pages, page_size, H, E]) is
three tensors, grouped along the last (head) dim only, so each token's row of every head is
self-contained: a cache appends a token by writing its rows, and a kernel reads a row's values
in 16-byte chunks with its group's scale beside them.

  format     data                              scales [..., E / G]     mins [..., E / G]
  "int8"     int8  [..., E]   x = q * s        one per row (G = E)     -
  "int8_g32" int8  [..., E]   x = q * s        G = 32                  -
  "int8_g64", "int8_g128": the same with G = 64, 128
  "q4_g32"   uint8 [..., E/2] x = q * s + m    G = 32                  G = 32
  "q4_g64":  the same with G = 64

int8 is symmetric: s = max|x| / 127 over the group, q = round(x / s) in [-127, 127]. 4-bit is
asymmetric (q4_1 / HQQ style): m = min x, s = (max x - m) / 15, q = round((x - m) / s) in
[0, 15]; byte j of a row holds element 2j in its low nibble and element 2j + 1 in its high
nibble. Scales (and mins) are float16 or float32, the dtype of the tensors given; q is computed
from the scale as stored, so the dequantization is exact up to the rounding of q. Keys and
values may use different formats. A row whose group is all zeros has s = 0 and dequantizes to 0.

QuantizedKV(data, scales, mins, format) holds one such tensor; torch_steel.sdpa and sdpa_varlen
take one as key and value (inference only) and pass its tensors and format to the op.
"""

import torch

# format -> (bits, group size; 0 = the whole row, one scale per (token, head))
FORMATS = {
    "int8": (8, 0),
    "int8_g32": (8, 32),
    "int8_g64": (8, 64),
    "int8_g128": (8, 128),
    "q4_g32": (4, 32),
    "q4_g64": (4, 64),
}
SCALE_DTYPES = (torch.float16, torch.float32)


def _format(name):
    if name not in FORMATS:
        raise ValueError(f"unknown KV format {name!r}: expected one of {', '.join(FORMATS)}")
    return FORMATS[name]


def group_size(format, head_dim):
    """The number of values that share a scale (the whole row for "int8")."""
    group = _format(format)[1]
    return group or head_dim


def check_head_dim(format, head_dim):
    bits, group = _format(format)
    if head_dim <= 0:
        raise ValueError(f"KV format {format}: head dim must be positive, got {head_dim}")
    if group and head_dim % group:
        raise ValueError(f"KV format {format}: head dim {head_dim} is not a multiple of {group}")
    if bits == 4 and head_dim % 2:
        raise ValueError(f"KV format {format}: head dim {head_dim} is odd (two values per byte)")


def _groups(x, group):
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def quantize(x, format, scale_dtype=torch.float16):
    """x [..., E] (floating) -> QuantizedKV in `format` with scales (and mins) of scale_dtype."""
    if not x.is_floating_point():
        raise TypeError(f"quantize: x must be floating, got {x.dtype}")
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"quantize: scale_dtype must be float16 or float32, got {scale_dtype}")
    E = x.shape[-1]
    check_head_dim(format, E)
    bits = FORMATS[format][0]
    g = _groups(x.to(torch.float64 if x.dtype == torch.float64 else torch.float32),
                group_size(format, E))  # fmt: skip
    if bits == 8:
        s = (g.abs().amax(-1) / 127).to(scale_dtype)
        sf = s.to(g.dtype).unsqueeze(-1)
        q = torch.where(sf > 0, g / torch.where(sf > 0, sf, 1), 0).round().clamp(-127, 127)
        data = q.reshape(x.shape).to(torch.int8)
        return QuantizedKV(data, s, None, format)
    lo, hi = g.amin(-1), g.amax(-1)
    m = lo.to(scale_dtype)
    s = ((hi - m.to(g.dtype)) / 15).to(scale_dtype)
    sf, mf = s.to(g.dtype).unsqueeze(-1), m.to(g.dtype).unsqueeze(-1)
    q = torch.where(sf > 0, (g - mf) / torch.where(sf > 0, sf, 1), 0).round().clamp(0, 15)
    q = q.reshape(*x.shape[:-1], E // 2, 2).to(torch.uint8)
    data = q[..., 0] | (q[..., 1] << 4)
    return QuantizedKV(data, s, m, format)


def unpack(kv):
    """The integer codes of a QuantizedKV, [..., E] (int16: int8's and 4-bit's ranges)."""
    if FORMATS[kv.format][0] == 8:
        return kv.data.to(torch.int16)
    d = kv.data.to(torch.int16)
    return torch.stack((d & 15, d >> 4), -1).reshape(*d.shape[:-1], d.shape[-1] * 2)


def dequantize(kv, dtype=torch.float32):
    """QuantizedKV -> [..., E] tensor of dtype, computed in float32 (float64 for float64)."""
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    q = unpack(kv).to(ct)
    E = q.shape[-1]
    g = _groups(q, group_size(kv.format, E))
    x = g * kv.scales.to(ct).unsqueeze(-1)
    if kv.mins is not None:
        x = x + kv.mins.to(ct).unsqueeze(-1)
    return x.reshape(q.shape).to(dtype)


class QuantizedKV:
    """A quantized key or value tensor: data, scales, mins (4-bit formats; else None), format.

    The tensors are views like any other (a preallocated cache's first n tokens are a narrowed
    QuantizedKV). shape is the logical [..., E] shape, head_dim E.
    """

    __slots__ = ("data", "scales", "mins", "format")

    def __init__(self, data, scales, mins, format):
        self.data, self.scales, self.mins, self.format = data, scales, mins, format
        validate(self)

    @property
    def head_dim(self):
        return self.data.shape[-1] * (2 if FORMATS[self.format][0] == 4 else 1)

    @property
    def shape(self):
        return torch.Size((*self.data.shape[:-1], self.head_dim))

    @property
    def device(self):
        return self.data.device

    def dim(self):
        return self.data.dim()

    def tensors(self):
        """(data, scales, mins): what the ops take, with the format string beside them."""
        return self.data, self.scales, self.mins

    def map(self, fn):
        """A QuantizedKV of fn applied to each tensor (a view along the leading dims, say)."""
        mins = None if self.mins is None else fn(self.mins)
        return QuantizedKV(fn(self.data), fn(self.scales), mins, self.format)

    def narrow(self, dim, start, length):
        """Tokens start .. start + length along a leading dim (dim < 0 counts from the end of
        the leading dims' shape, the head dim included: -2 is the token dim of [B, H, S, E])."""
        if dim % self.data.dim() == self.data.dim() - 1:
            raise ValueError("QuantizedKV.narrow: the head dim cannot be narrowed")
        return self.map(lambda t: t.narrow(dim, start, length))

    def dequantize(self, dtype=torch.float32):
        return dequantize(self, dtype)

    @staticmethod
    def empty(shape, format, scale_dtype=torch.float16, device=None):
        """A zero-filled quantized tensor of logical shape [..., E], to write tokens into."""
        *lead, E = shape
        check_head_dim(format, E)
        bits = FORMATS[format][0]
        width, dtype = (E, torch.int8) if bits == 8 else (E // 2, torch.uint8)
        data = torch.zeros(*lead, width, dtype=dtype, device=device)
        n = E // group_size(format, E)
        scales = torch.zeros(*lead, n, dtype=scale_dtype, device=device)
        mins = torch.zeros_like(scales) if bits == 4 else None
        return QuantizedKV(data, scales, mins, format)

    def write_(self, index, x):
        """Quantizes x and stores it at self[index] (an index of the leading dims: a dense
        cache's [:, :, pos:pos + n], a paged pool's [page, slot]). The scales' dtype is kept."""
        q = quantize(x, self.format, self.scales.dtype)
        self.data[index] = q.data
        self.scales[index] = q.scales
        if self.mins is not None:
            self.mins[index] = q.mins
        return self

    def append_(self, x, start, dim=-2):
        """Writes tokens x (x.shape[dim] of them) at positions start.. along dim of a
        preallocated cache; returns the cache's first start + x.shape[dim] tokens."""
        n = x.shape[dim]
        if start < 0 or start + n > self.shape[dim]:
            raise ValueError(
                f"QuantizedKV.append_: tokens {start}..{start + n} do not fit the cache's "
                f"{self.shape[dim]} along dim {dim}"
            )
        index = [slice(None)] * self.data.dim()
        index[dim] = slice(start, start + n)
        self.write_(tuple(index), x)
        return self.narrow(dim, 0, start + n)

    def __repr__(self):
        scale = str(self.scales.dtype).removeprefix("torch.")
        return f"QuantizedKV({self.format}, shape={list(self.shape)}, scales={scale})"


def validate(kv, op="QuantizedKV"):
    """Raises a ValueError / TypeError naming what is wrong with a QuantizedKV's tensors."""
    if kv.format not in FORMATS:
        raise ValueError(f"{op}: unknown KV format {kv.format!r}: expected one of "
                         f"{', '.join(FORMATS)}")  # fmt: skip
    bits = FORMATS[kv.format][0]
    data, scales, mins = kv.data, kv.scales, kv.mins
    for name, t in (("data", data), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
    want = torch.int8 if bits == 8 else torch.uint8
    if data.dtype != want:
        raise TypeError(f"{op}: {kv.format} data must be {want}, got {data.dtype}")
    if data.dim() < 1:
        raise ValueError(f"{op}: data must have a head dim")
    E = data.shape[-1] * (2 if bits == 4 else 1)
    check_head_dim(kv.format, E)
    if scales.dtype not in SCALE_DTYPES:
        raise TypeError(f"{op}: scales must be float16 or float32, got {scales.dtype}")
    shape = (*data.shape[:-1], E // group_size(kv.format, E))
    if tuple(scales.shape) != shape:
        raise ValueError(f"{op}: {kv.format} scales must have shape {list(shape)}, got "
                         f"{list(scales.shape)}")  # fmt: skip
    if bits == 4:
        if not isinstance(mins, torch.Tensor):
            raise TypeError(f"{op}: {kv.format} needs mins (a Tensor like scales)")
        if mins.shape != scales.shape or mins.dtype != scales.dtype:
            raise ValueError(f"{op}: mins must have the scales' shape and dtype")
    elif mins is not None:
        raise ValueError(f"{op}: {kv.format} is symmetric and takes no mins")
    for name, t in (("scales", scales), ("mins", mins)):
        if t is not None and t.device != data.device:
            raise ValueError(f"{op}: {name} are on {t.device} but data on {data.device}")
