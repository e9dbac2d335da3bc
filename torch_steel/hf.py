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

A quantized KV cache (torch_steel.kv formats) for generation:

    cache = torch_steel.hf.quantized_cache(k_format="int8_g64", v_format="q4_g32")
    model.generate(ids, past_key_values=cache)   # with attn_implementation="steel"

stores each layer's keys and values quantized as they arrive (one token at a time in decode)
and hands the QuantizedKV to steel's attention (torch.ops.steel.sdpa_quantized_forward), which
takes them as they are. transformers is imported only by register() and quantized_cache().
"""

import torch

from . import ops
from .kv import QuantizedKV

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
    if isinstance(key, QuantizedKV):
        return _quantized_attention(module, query, key, value, attention_mask, scaling,
                                    sliding_window, softcap, is_causal, s_aux)  # fmt: skip
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


def _quantized_attention(module, query, key, value, attention_mask, scaling, sliding_window,
                         softcap, is_causal, s_aux):  # fmt: skip
    """A quantized cache's keys and values ([B, Hkv, S, D] QuantizedKV): dense steel.sdpa, the
    last query row aligned with the last key; a 2-D padding mask [B, S] hides padded keys."""
    S = key.shape[-2]
    mask = None
    if attention_mask is not None:
        mask = attention_mask[:, None, None, -S:].bool()
    window = None
    if sliding_window is not None:
        window = (sliding_window - 1, 0 if is_causal else sliding_window - 1)
    out = ops.sdpa(
        query, key, value, mask, is_causal=bool(is_causal), scale=scaling, enable_gqa=True,
        sinks=s_aux, softcap=softcap or None, window=window, causal_align="bottom_right",
    )  # fmt: skip
    return out.transpose(1, 2), None


_CACHE_CLASSES = {}


def _cache_classes():
    """QuantizedKVLayer and QuantizedKVCache, made once transformers is imported."""
    if _CACHE_CLASSES:
        return _CACHE_CLASSES["layer"], _CACHE_CLASSES["cache"]
    from transformers.cache_utils import Cache, CacheLayerMixin

    class QuantizedKVLayer(CacheLayerMixin):
        """One layer's keys and values, [B, Hkv, capacity, D] QuantizedKV grown by doubling;
        update() quantizes the new tokens into place and returns views of the tokens so far."""

        is_sliding = False
        is_compileable = False

        def __init__(self, k_format, v_format, scale_dtype):
            super().__init__()
            self.formats = (k_format, v_format)
            self.scale_dtype = scale_dtype
            self.length = 0

        def lazy_initialization(self, key_states, value_states):
            self.device = key_states.device
            self.keys = self._empty(key_states, self.formats[0], 16)
            self.values = self._empty(value_states, self.formats[1], 16)
            self.is_initialized = True

        def _empty(self, x, format, capacity):
            B, H, _, D = x.shape
            return QuantizedKV.empty((B, H, capacity, D), format, self.scale_dtype, x.device)

        def _grown(self, cache, x, format, needed):
            if needed <= cache.shape[-2]:
                return cache
            bigger = self._empty(x, format, max(needed, 2 * cache.shape[-2]))
            for new, old in zip(bigger.tensors(), cache.tensors()):
                if new is not None:
                    new[:, :, : self.length].copy_(old[:, :, : self.length])
            return bigger

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = self.length + key_states.shape[-2]
            self.keys = self._grown(self.keys, key_states, self.formats[0], n)
            self.values = self._grown(self.values, value_states, self.formats[1], n)
            k = self.keys.append_(key_states, self.length)
            v = self.values.append_(value_states, self.length)
            self.length = n
            return k, v

        def get_mask_sizes(self, query_length):
            return self.get_seq_length() + query_length, 0

        def get_seq_length(self):
            return self.length

        def get_max_length(self):
            return -1

        def reset(self):
            self.keys = self.values = None
            self.length = 0
            self.is_initialized = False

    class QuantizedKVCache(Cache):
        """A transformers Cache of QuantizedKVLayer (torch_steel.kv formats): for
        attn_implementation="steel" (register()), which reads the QuantizedKV as they are."""

        def __init__(self, num_layers=None, k_format="int8_g64", v_format=None,
                     scale_dtype=torch.float16):  # fmt: skip
            v_format = k_format if v_format is None else v_format

            def layer():
                return QuantizedKVLayer(k_format, v_format, scale_dtype)

            if num_layers is None:
                super().__init__(layer_class_to_replicate=layer)
            else:
                super().__init__(layers=[layer() for _ in range(num_layers)])

    _CACHE_CLASSES.update(layer=QuantizedKVLayer, cache=QuantizedKVCache)
    return QuantizedKVLayer, QuantizedKVCache


def quantized_cache(num_layers=None, k_format="int8_g64", v_format=None,
                    scale_dtype=torch.float16):  # fmt: skip
    """A transformers Cache storing keys and values quantized (v_format defaults to k_format;
    scales float16 or float32), for model.generate(..., past_key_values=cache) with
    attn_implementation="steel". Inference only, like the quantized attention it feeds."""
    register()
    return _cache_classes()[1](num_layers, k_format, v_format, scale_dtype)


def register(name=NAME):
    """Registers `name` in transformers' AttentionInterface (varlen_attention_forward) and
    AttentionMaskInterface (the flash-attention mask: None, or the 2-D padding mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, varlen_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
