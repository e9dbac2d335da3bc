"""Hugging Face transformers: steel's varlen attention as an attention function.

Models with attn_implementation="sdpa" need nothing from here: they call
F.scaled_dot_product_attention, which torch_steel.patch() serves. This module adds what the
flash-attention-2 path gives transformers, padding-free and packed batches without an L x S
mask, through transformers' attention-function registry:

    import torch_steel.hf
    torch_steel.hf.register()             # registers "steel" (attention and mask functions)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="steel")
    # packed: input_ids [1, total], position_ids restarting at 0 for each sequence (as
    # DataCollatorWithFlattening makes them; its cu_seq_lens_* are used when given)

Each layer's attention then runs torch.ops.steel.sdpa_varlen over the packed tokens. A 2-D
padding mask (batch rows of different lengths) is unpadded into the same packed form.
transformers is imported only by register().
"""

import torch

from . import ops

NAME = "steel"


def _cu_from_lengths(lengths):
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu


def _cu_from_position_ids(position_ids):
    """Packed position_ids [1, total] restarting at 0 per sequence -> int32 cu_seqlens."""
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().reshape(-1)
    if starts.numel() == 0 or starts[0] != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    lengths = torch.diff(torch.cat([starts, starts.new_full((1,), flat.numel())]))
    return _cu_from_lengths(lengths.to(torch.int32))


def _packed(x):
    """[B, H, L, D] (transformers' layout for attention functions) -> [B * L, H, D]."""
    B, H, L, D = x.shape
    return x.transpose(1, 2).reshape(B * L, H, D)


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None,
                             dropout=0.0, sliding_window=None, softcap=None, is_causal=None,
                             position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                             max_length_q=None, max_length_k=None, s_aux=None,
                             **kwargs):  # fmt: skip
    """transformers attention function (query [B, H, L, D], key/value [B, Hkv, S, D]) ->
    ([B, L, H, Dv], None), served by steel::sdpa_varlen. s_aux: gpt-oss's per-head sinks."""
    B, H, L, _ = query.shape
    S = key.shape[-2]
    Dv = value.shape[-1]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q, k, v = _packed(query), _packed(key), _packed(value)
    rows_q = rows_k = None
    if cu_seq_lens_q is not None and cu_seq_lens_k is not None:
        cu_q, cu_k = cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32)
    elif attention_mask is not None:  # 2-D padding mask [B, S] (True = token): unpad
        keep_k = attention_mask[:, -S:].bool()
        keep_q = keep_k[:, -L:]
        rows_q, rows_k = keep_q.reshape(-1).nonzero().reshape(-1), keep_k.reshape(-1).nonzero()
        rows_k = rows_k.reshape(-1)
        q, k, v = q[rows_q], k[rows_k], v[rows_k]
        cu_q = _cu_from_lengths(keep_q.sum(1, dtype=torch.int32))
        cu_k = _cu_from_lengths(keep_k.sum(1, dtype=torch.int32))
    elif B == 1 and position_ids is not None and L == S:
        cu_q = cu_k = _cu_from_position_ids(position_ids)
    else:  # one sequence per batch row
        cu_q = torch.arange(B + 1, dtype=torch.int32, device=query.device) * L
        cu_k = torch.arange(B + 1, dtype=torch.int32, device=query.device) * S
    max_q = int(max_length_q) if max_length_q is not None else int(cu_q.diff().max())
    max_k = int(max_length_k) if max_length_k is not None else int(cu_k.diff().max())
    window = None
    if sliding_window is not None:
        window = (sliding_window - 1, 0 if is_causal else sliding_window - 1)
    out = ops.sdpa_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k,
        dropout_p=dropout if module.training else 0.0, is_causal=bool(is_causal), scale=scaling,
        sinks=s_aux, softcap=softcap or None, window=window, causal_align="bottom_right",
    )  # fmt: skip
    if rows_q is not None:
        full = out.new_zeros(B * L, H, Dv)
        out = full.index_copy(0, rows_q, out)
    return out.reshape(B, L, H, Dv), None


def register(name=NAME):
    """Registers `name` in transformers' AttentionInterface (varlen_attention_forward) and
    AttentionMaskInterface (the flash-attention mask: None, or the 2-D padding mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, varlen_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
