"""torch_steel.hf.quantized_cache: model.generate on tiny Llamas (GQA and MHA, built from configs,
no downloads) with attn_implementation="steel" and a quantized cache. The oracle is the same
model on PyTorch's own attention ("sdpa") with a plain DynamicLayer cache holding the
quantized-then-dequantized keys and values: the same numbers, so the logits agree to float64
rounding and a wrong token order, scale or append would not."""

import pytest
import torch

import torch_steel
from torch_steel import kv

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

import torch_steel.hf  # noqa: E402


def _llama(kv_heads):
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().eval()


def _fake_quantized_cache(k_format, v_format):
    class FakeQuantized(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            k = kv.quantize(key_states, k_format).dequantize(key_states.dtype)
            v = kv.quantize(value_states, v_format).dequantize(value_states.dtype)
            return super().update(k, v, *args, **kwargs)

    return Cache(layer_class_to_replicate=FakeQuantized)


def _generate(model, ids, mask, cache):
    out = model.generate(
        ids, attention_mask=mask, past_key_values=cache, max_new_tokens=21, do_sample=False,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )  # fmt: skip
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("k_format,v_format", [("int8_g32", "q4_g32"), ("q4_g32", "int8")])
def test_generate_with_quantized_cache(kv_heads, k_format, v_format):
    model = _llama(kv_heads)
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: hidden keys, and query rows that see nothing
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want_ids, want = _generate(model, ids, mask, _fake_quantized_cache(k_format, v_format))
        model.set_attn_implementation(torch_steel.hf.register())
        cache = torch_steel.hf.quantized_cache(k_format=k_format, v_format=v_format)
        with torch_steel.backend("reference"):
            got_ids, got = _generate(model, ids, mask, cache)
    layer = cache.layers[0]
    assert isinstance(layer.keys, kv.QuantizedKV) and layer.keys.format == k_format
    assert layer.values.format == v_format
    assert cache.get_seq_length() == 6 + 21 - 1  # grown past its first 16 tokens, by doubling
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)  # float64 throughout


def test_quantized_cache_is_inference_only():
    model = _llama(2)
    model.set_attn_implementation(torch_steel.hf.register())
    ids = torch.randint(1, 97, (1, 5))
    with torch_steel.backend("reference"), pytest.raises(RuntimeError, match="inference only"):
        model(ids, past_key_values=torch_steel.hf.quantized_cache(k_format="int8"))
