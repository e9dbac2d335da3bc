"""Models from Hugging Face transformers and diffusers, built tiny and random from configs (no
downloads), under torch_steel.patch(): the same logits and gradients as without it. CPU keys
and the "reference" backend stand in for MPS (see test_ops_patch.py)."""

import pytest
import torch

import torch_steel
from torch_steel import patching

CPU = ("mps", "cpu")
transformers = pytest.importorskip("transformers")


def _steel(fn):
    with torch_steel.backend("reference"), torch_steel.patch(devices=CPU):
        return fn()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(got, expected):
    assert got.keys() == expected.keys() and got
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name)


def _llama(**overrides):
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double()


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_sdpa_model_under_patch_matches(make, steel_calls):
    model = make()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 97, (2, 7))
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding: rows of the mask that see nothing

    def run():
        model.zero_grad()
        out = model(ids, attention_mask=attention_mask, labels=ids)
        out.loss.backward()
        return out.logits.detach(), _grads(model)

    expected, expected_grads = run()
    got, grads = _steel(run)
    assert steel_calls.count("forward") == 2 and steel_calls.count("backward") == 2
    torch.testing.assert_close(got, expected)
    _assert_same_grads(grads, expected_grads)


def test_packed_training_through_the_attention_registry(steel_calls):
    """Padding-free packing (position_ids restart per sequence) with attn_implementation
    "steel" (torch_steel.hf): each layer runs steel.sdpa_varlen; logits and gradients equal
    running the sequences one by one."""
    import torch_steel.hf

    torch_steel.hf.register()
    model = _llama()
    lengths = [3, 5, 4]
    seqs = [torch.randint(0, 97, (1, n)) for n in lengths]
    packed = torch.cat(seqs, 1)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)

    model.set_attn_implementation("steel")
    logits = model(packed, position_ids=position_ids).logits
    logits.sum().backward()
    grads = _grads(model)
    assert steel_calls.count("varlen_forward") == 2 and steel_calls.count("varlen_backward") == 2

    model.zero_grad()
    model.set_attn_implementation("sdpa")
    expected = torch.cat([model(s).logits for s in seqs], 1)
    expected.sum().backward()
    torch.testing.assert_close(logits, expected)
    _assert_same_grads(grads, _grads(model))


def test_varlen_attention_function_unpads_a_padding_mask(steel_calls):
    import torch_steel.hf

    torch_steel.hf.register()
    model = _llama()
    ids = torch.randint(0, 97, (2, 6))
    attention_mask = torch.ones(2, 6, dtype=torch.long)
    attention_mask[0, 4:] = 0  # right padding
    model.set_attn_implementation("steel")
    got = model(ids, attention_mask=attention_mask).logits
    assert steel_calls.count("varlen_forward") == 2
    model.set_attn_implementation("sdpa")
    expected = model(ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    torch.testing.assert_close(got[keep], expected[keep])


def test_diffusers_unet_head_dims_of_sd15(monkeypatch):
    """A tiny random UNet2DConditionModel whose attention head dims are Stable Diffusion 1.5's
    (40, 80, 160): patched and unpatched outputs and gradients are equal."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(40, 80, 160), attention_head_dim=1, norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D",) * 3, up_block_types=("UpBlock2D",) * 3,
        cross_attention_dim=24,
    ).double()  # fmt: skip
    sample = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    text = torch.randn(1, 5, 24, dtype=torch.float64)
    head_dims = []
    real = patching.ops.sdpa

    def spy(query, *args, **kwargs):
        head_dims.append(query.shape[-1])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(patching.ops, "sdpa", spy)

    def run():
        unet.zero_grad()
        out = unet(sample, 10, encoder_hidden_states=text).sample
        out.square().mean().backward()
        return out.detach(), _grads(unet)

    expected, expected_grads = run()
    assert head_dims == []
    got, grads = _steel(run)
    assert set(head_dims) == {40, 80, 160}
    torch.testing.assert_close(got, expected)
    _assert_same_grads(grads, expected_grads)
