"""Bad input is a clear error naming the problem, never a crash or a silent wrong answer."""

import re

import pytest
import torch

import torch_steel


def q_(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


SDPA_CASES = [
    (
        "dtype",
        (q_(1, 2, 3, 4), q_(1, 2, 3, 4, dtype=torch.float64), q_(1, 2, 3, 4)),
        {},
        "query, key, value must share one dtype, got float32, float64, float32",
    ),
    (
        "integer",
        (torch.ones(1, 2, 3, 4, dtype=torch.int32),) * 3,
        {},
        "query must be a floating-point tensor",
    ),
    ("rank", (q_(1, 2, 3, 4), q_(4), q_(4)), {}, "key must be a tensor of rank >= 2"),
    (
        "head dim",
        (q_(1, 2, 3, 4), q_(1, 2, 3, 5), q_(1, 2, 3, 5)),
        {},
        "query and key head dims differ: 4 vs 5",
    ),
    (
        "kv lengths",
        (q_(1, 2, 3, 4), q_(1, 2, 3, 4), q_(1, 2, 6, 4)),
        {},
        "key [1, 2, 3, 4] and value [1, 2, 6, 4] must agree",
    ),
    (
        "heads without gqa",
        (q_(1, 4, 3, 4), q_(1, 2, 3, 4), q_(1, 2, 3, 4)),
        {},
        "pass enable_gqa=True",
    ),
    (
        "gqa divisibility",
        (q_(1, 3, 3, 4), q_(1, 2, 3, 4), q_(1, 2, 3, 4)),
        {"enable_gqa": True},
        "query heads (3) divisible by key/value heads (2)",
    ),
    (
        "batch",
        (q_(2, 2, 3, 4), q_(3, 2, 3, 4), q_(3, 2, 3, 4)),
        {},
        "batch dims of query [2] and key [3] differ",
    ),
    (
        "mask shape",
        (q_(1, 2, 3, 4), q_(1, 2, 5, 4), q_(1, 2, 5, 4), torch.ones(3, 4).bool()),
        {},
        "attn_mask of shape [3, 4] does not broadcast to the attention shape [1, 2, 3, 5]",
    ),
    (
        "mask dtype",
        (q_(1, 2, 3, 4),) * 3 + (torch.ones(3, 3, dtype=torch.int64),),
        {},
        "attn_mask must be bool (True = attend) or floating",
    ),
    (
        "sinks shape",
        (q_(1, 2, 3, 4),) * 3,
        {"sinks": q_(3)},
        "sinks must have shape [2] (one logit per query head), got [3]",
    ),
    ("dropout", (q_(1, 2, 3, 4),) * 3 + (None, 1.5), {}, "dropout_p must be in [0, 1], got 1.5"),
    ("window", (q_(1, 2, 3, 4),) * 3, {"window": (1, -2)}, "window must be (left, right)"),
    (
        "align",
        (q_(1, 2, 3, 4),) * 3,
        {"causal_align": "lower_right"},
        "causal_align must be one of ('top_left', 'bottom_right')",
    ),
    ("softcap", (q_(1, 2, 3, 4),) * 3, {"softcap": -1.0}, "softcap must be a finite number >= 0"),
    ("seed", (q_(1, 2, 3, 4),) * 3 + (None, 0.5), {"seed": 2**63}, "seed must be in [0, 2**63)"),
]


@pytest.mark.parametrize("name,args,kwargs,message", SDPA_CASES, ids=[c[0] for c in SDPA_CASES])
def test_sdpa_errors(name, args, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        torch_steel.sdpa(*args, **kwargs)


def test_sdpa_device_mismatch():
    q = q_(1, 2, 3, 4)
    with pytest.raises(ValueError, match=re.escape("must be on one device, got cpu, meta, cpu")):
        torch.ops.steel.sdpa(q, q.to("meta"), q)


def test_sdpa_backward_mask_grad_needs_a_float_mask():
    q = q_(1, 2, 3, 4)
    lse = torch.zeros(1, 2, 3)
    mask = torch.ones(3, 3, dtype=torch.bool)
    args = (q, None, q, q, q, q, lse, mask, True, 0.0, False, 0.5, None, 0.0, -1, -1, False, 0, 0)
    with pytest.raises(ValueError, match="mask_grad needs a float attn_mask"):
        torch.ops.steel.sdpa_backward(*args)


def test_ops_without_a_gradient_say_so_when_one_is_wanted():
    """The paged KV cache's forward is inference only and the backward ops have no gradient of
    their own: a call that wants one is an error at once (never outputs that silently do not
    require grad); the same calls without grad run."""
    q, k, v = q_(3, 2, 4).requires_grad_(), q_(4, 2, 2, 4), q_(4, 2, 2, 4)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    used = torch.tensor([3, 4], dtype=torch.int32)
    paged = (cu, table, used, 2, 4, 0.0, False, 0.5, None, 0.0, -1, -1, False, 0, 0)
    with pytest.raises(RuntimeError, match="steel::sdpa_paged_forward has no gradient"):
        torch.ops.steel.sdpa_paged_forward(q, k, v, *paged)
    with torch.no_grad():
        out, lse = torch.ops.steel.sdpa_paged_forward(q, k, v, *paged)
    assert out.shape == (3, 2, 4) and lse.shape == (2, 3)
    g = q_(1, 2, 3, 4)
    lse = torch.zeros(1, 2, 3)
    args = (g, None, g.clone().requires_grad_(), g, g, g, lse, None, False, 0.0, False, 0.5)
    with pytest.raises(RuntimeError, match="steel::sdpa_backward has no gradient"):
        torch.ops.steel.sdpa_backward(*args, None, 0.0, -1, -1, False, 0, 0)


def test_causal_bias_length_mismatch():
    from torch.nn.attention.bias import causal_lower_right

    q = q_(1, 2, 3, 4)
    with pytest.raises(ValueError, match=re.escape("CausalBias is for (L, S) = (3, 5)")):
        torch_steel.sdpa(q, q, q, causal_lower_right(3, 5))


def _cu(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


VARLEN_CASES = [
    (
        "int64 offsets",
        (_cu(0, 2, 5, dtype=torch.int64), _cu(0, 2, 5)),
        "cu_seqlens_q must be a 1-D int32 tensor",
    ),
    ("not monotone", (_cu(0, 4, 2, 5), _cu(0, 1, 2, 5)), "cu_seqlens_q must be non-decreasing"),
    ("bad end", (_cu(0, 2, 4), _cu(0, 2, 5)), "cu_seqlens_q must start at 0 and end at the token"),
    ("lengths differ", (_cu(0, 5), _cu(0, 2, 5)), "must have the same length (batch + 1)"),
    ("max_seqlen", (_cu(0, 1, 5), _cu(0, 2, 5)), "sequence of length 4 > max_seqlen 3"),
]


@pytest.mark.parametrize("name,cus,message", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_varlen_errors(name, cus, message):
    q = q_(5, 2, 4)
    with pytest.raises(ValueError, match=re.escape(message)):
        torch_steel.sdpa_varlen(q, q, q, *cus, 3, 3)


def test_varlen_shape_errors():
    with pytest.raises(ValueError, match=re.escape("query must be packed [total_tokens, heads")):
        torch_steel.sdpa_varlen(
            q_(1, 5, 2, 4), q_(5, 2, 4), q_(5, 2, 4), _cu(0, 5), _cu(0, 5), 5, 5
        )
    with pytest.raises(ValueError, match=re.escape("query heads (3) must be a multiple")):
        torch_steel.sdpa_varlen(q_(5, 3, 4), q_(5, 2, 4), q_(5, 2, 4), _cu(0, 5), _cu(0, 5), 5, 5)


GEMM_CASES = [
    ("inner", (q_(3, 4), q_(5, 6)), {}, "inner dims differ: a is [3, 4], b is [5, 6]"),
    ("rank", (q_(4), q_(4, 6)), {}, "a and b must be at least 2-D"),
    (
        "dtype",
        (q_(3, 4), q_(4, 6, dtype=torch.float16)),
        {},
        "a, b must share one dtype, got float32, float16",
    ),
    ("batch", (q_(2, 3, 4), q_(3, 4, 6)), {}, "batch dims of a [2] and b [3] do not broadcast"),
    ("bias", (q_(3, 4), q_(4, 6)), {"bias": q_(3)}, "bias must have shape [N] = [6], got [3]"),
    (
        "c",
        (q_(3, 4), q_(4, 6)),
        {"c": q_(2, 6), "beta": 1.0},
        "c of shape [2, 6] does not broadcast to the output shape [3, 6]",
    ),
    (
        "activation",
        (q_(3, 4), q_(4, 6)),
        {"activation": "tanh"},
        "activation must be one of ('none', 'relu', 'gelu', 'gelu_tanh', 'silu'), got 'tanh'",
    ),
]


@pytest.mark.parametrize("name,args,kwargs,message", GEMM_CASES, ids=[c[0] for c in GEMM_CASES])
def test_gemm_errors(name, args, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        torch_steel.gemm(*args, **kwargs)


def test_gemm_device_mismatch():
    with pytest.raises(ValueError, match="must be on one device"):
        torch_steel.gemm(q_(3, 4), q_(4, 6).to("meta"))


def test_device_offsets_are_checked_from_metadata_only():
    """cu_seqlens on a device are never read on the host (a device sync per call on MPS; the
    kernels clamp offsets themselves): bad values pass, a bad dtype or length is still named.
    Meta tensors stand in for device memory: reading one raises."""
    from torch_steel import validation

    bad_values = torch.tensor([0, 7, 2], dtype=torch.int32, device="meta")
    meta = bad_values.device
    validation.check_cu_seqlens("sdpa_varlen", bad_values, bad_values, 5, 5, 3, 3, meta)
    with pytest.raises(ValueError, match="cu_seqlens_k must be a 1-D int32 tensor"):
        validation.check_cu_seqlens("sdpa_varlen", bad_values, bad_values.long(), 5, 5, 3, 3, meta)
    with pytest.raises(ValueError, match=re.escape("must have the same length (batch + 1)")):
        validation.check_cu_seqlens("sdpa_varlen", bad_values, bad_values[:2], 5, 5, 3, 3, meta)
