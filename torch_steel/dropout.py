"""Counter-based dropout for attention: Philox4x32-10 computed with torch integer ops.

The keep/drop decision of attention weight (batch, head, row, col) is a pure function of
(seed, offset, batch, head, row, col), so the backward pass regenerates the forward's mask
without storing it, and a Metal kernel can reproduce it bit for bit with 32-bit integer math.

The scheme (a kernel must follow it exactly):
  key     = (seed mod 2**32, seed // 2**32)                  seed in [0, 2**63)
  counter = (col // 4, row, batch * heads + head, offset)    each word mod 2**32
  word    = philox4x32_10(counter, key)[col % 4]
  keep    = word >= threshold,  threshold = floor(dropout_p * 2**32)  (dropout_p == 1 keeps none)
Kept weights are scaled by 1 / (1 - dropout_p). Batch is the flattened index of the dims before
the head dim (the sequence index for sdpa_varlen); row and col are positions in the sequence.

All arithmetic stays in int64 with values below 2**49, so it is exact on every torch device.
"""

import torch

_MASK32 = 0xFFFFFFFF
_MUL0 = 0xD2511F53
_MUL1 = 0xCD9E8D57
_WEYL0 = 0x9E3779B9
_WEYL1 = 0xBB67AE85
ROUNDS = 10


def _mulhilo(a, multiplier):
    """(hi, lo) 32-bit halves of a * multiplier for uint32 values held in int64 tensors.

    The multiplier is split in 16-bit halves so that no partial product reaches 2**63.
    """
    low = a * (multiplier & 0xFFFF)
    high = a * (multiplier >> 16)
    mid = low + ((high & 0xFFFF) << 16)
    return (high >> 16) + (mid >> 32), mid & _MASK32


def philox4x32(c0, c1, c2, c3, k0, k1, rounds=ROUNDS):
    """Philox4x32 (Salmon et al., SC'11) on broadcastable int64 tensors holding uint32 values.

    Returns the four output words as int64 tensors in [0, 2**32).
    """
    k0 = torch.as_tensor(k0, dtype=torch.int64)
    k1 = torch.as_tensor(k1, dtype=torch.int64)
    for i in range(rounds):
        if i > 0:
            k0 = (k0 + _WEYL0) & _MASK32
            k1 = (k1 + _WEYL1) & _MASK32
        hi0, lo0 = _mulhilo(c0, _MUL0)
        hi1, lo1 = _mulhilo(c2, _MUL1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def keep_threshold(dropout_p: float) -> int:
    """Words at or above this value are kept; 2**32 (nothing kept) when dropout_p == 1."""
    return min(int(dropout_p * 2**32), 2**32)


def keep_mask(seed, offset, batch_head, rows, cols, dropout_p, device=None):
    """Bool keep-mask of shape [len(batch_head), rows, cols].

    batch_head: int64 tensor (or list) of flattened batch * heads + head indices, one per slice.
    rows, cols: ints (positions 0..rows-1, 0..cols-1) or int64 tensors of positions.
    """
    if not 0 <= seed < 2**63:
        raise ValueError(f"dropout seed must be in [0, 2**63) (an int64), got {seed}")
    if not 0 <= offset < 2**32:
        raise ValueError(f"dropout offset must be in [0, 2**32), got {offset}")
    bh = torch.as_tensor(batch_head, dtype=torch.int64, device=device).reshape(-1, 1, 1)
    r = rows if torch.is_tensor(rows) else torch.arange(rows, device=device)
    c = cols if torch.is_tensor(cols) else torch.arange(cols, device=device)
    r = r.to(device=bh.device, dtype=torch.int64).reshape(1, -1, 1)
    c = c.to(device=bh.device, dtype=torch.int64).reshape(1, 1, -1)
    words = philox4x32(
        c // 4,
        r & _MASK32,
        bh & _MASK32,
        torch.full((), offset, dtype=torch.int64, device=bh.device),
        seed & _MASK32,
        seed >> 32,
    )
    lane = c % 4
    word = torch.where(
        lane == 0,
        words[0],
        torch.where(lane == 1, words[1], torch.where(lane == 2, words[2], words[3])),
    )
    return word >= keep_threshold(dropout_p)
