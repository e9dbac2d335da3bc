"""torch.library.opcheck (schema, fake tensors, autograd registration, AOT dispatch) on every op."""

import pytest
import torch

import torch_steel  # noqa: F401 (registers torch.ops.steel)


def _t(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, dtype=dtype, requires_grad=grad)


def _cu(*offsets):
    return torch.tensor(offsets, dtype=torch.int32)


ATTN = (0.0, True, 0.5)  # dropout_p, is_causal, scale
EXT = (1.5, 2, -1, True, 0, 0)  # softcap, window_left, window_right, bottom_right, seed, offset
CASES = {
    "sdpa": (
        torch.ops.steel.sdpa,
        (_t(1, 4, 3, 8, grad=True), _t(1, 2, 5, 8, grad=True), _t(1, 2, 5, 6, grad=True)),
        {"enable_gqa": True, "sinks": _t(4, grad=True), "softcap": 2.0, "window": [1, 0]},
    ),
    "sdpa_mask_dropout": (
        torch.ops.steel.sdpa,
        (
            _t(2, 2, 3, 4, grad=True),
            _t(2, 2, 5, 4, grad=True),
            _t(2, 2, 5, 4, grad=True),
            torch.rand(3, 5) > 0.2,
            0.3,
        ),
        {"seed": 7},
    ),
    # Transposed views ([batch, seq, heads, dim] storage): outputs must still match the fakes.
    "sdpa_noncontiguous": (
        torch.ops.steel.sdpa,
        tuple(_t(2, 5, 2, 4, grad=True).transpose(1, 2) for _ in range(3)),
        {"is_causal": True},
    ),
    "sdpa_forward": (
        torch.ops.steel.sdpa_forward,
        (
            _t(1, 2, 3, 4, grad=True),
            _t(1, 2, 5, 4, grad=True),
            _t(1, 2, 5, 4, grad=True),
            _t(3, 5),
            *ATTN,
            _t(2, grad=True),
            *EXT,
        ),
        {},
    ),
    "sdpa_backward": (
        torch.ops.steel.sdpa_backward,
        (
            _t(1, 2, 3, 4),
            _t(1, 2, 3),
            _t(1, 2, 3, 4),
            _t(1, 2, 5, 4),
            _t(1, 2, 5, 4),
            _t(1, 2, 3, 4),
            _t(1, 2, 3),
            _t(3, 5),
            True,
            *ATTN,
            None,
            *EXT,
        ),
        {},
    ),
    "sdpa_varlen": (
        torch.ops.steel.sdpa_varlen,
        (
            _t(5, 2, 4, grad=True),
            _t(7, 1, 4, grad=True),
            _t(7, 1, 4, grad=True),
            _cu(0, 2, 5),
            _cu(0, 3, 7),
            3,
            4,
            0.0,
            True,
        ),
        {"sinks": _t(2, grad=True)},
    ),
    "sdpa_varlen_backward": (
        torch.ops.steel.sdpa_varlen_backward,
        (
            _t(5, 2, 4),
            None,
            _t(5, 2, 4),
            _t(7, 2, 4),
            _t(7, 2, 4),
            _t(5, 2, 4),
            _t(2, 5),
            _cu(0, 2, 5),
            _cu(0, 3, 7),
            3,
            4,
            *ATTN,
            _t(2),
            *EXT,
        ),
        {},
    ),
    # A paged KV cache (inference only: no autograd, so no gradients asked for).
    "sdpa_paged_forward": (
        torch.ops.steel.sdpa_paged_forward,
        (
            _t(3, 4, 8),
            _t(5, 4, 2, 8),
            _t(5, 4, 2, 6),
            _cu(0, 1, 3),
            torch.tensor([[4, 0], [2, -1]], dtype=torch.int32),
            torch.tensor([7, 3], dtype=torch.int32),
            2,
            7,
            *ATTN,
            _t(4),
            *EXT,
            1,
        ),
        {},
    ),
    "gemm": (
        torch.ops.steel.gemm,
        (
            _t(2, 3, 4, grad=True),
            _t(4, 5, grad=True),
            _t(5, grad=True),
            _t(3, 5, grad=True),
            0.5,
            2.0,
            "silu",
        ),
        {},
    ),
}


# The prechecked twins that torch.compile graphs call take every argument, without defaults.
CASES["sdpa_forward_prechecked"] = (
    torch.ops.steel.sdpa_forward_prechecked,
    (*CASES["sdpa_forward"][1], 0),  # num_splits
    {},
)
CASES["gemm_prechecked"] = (torch.ops.steel.gemm_prechecked, CASES["gemm"][1], {})


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck(name):
    op, args, kwargs = CASES[name]
    torch.library.opcheck(op, args, kwargs)
