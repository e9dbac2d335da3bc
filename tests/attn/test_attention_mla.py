"""Multi-head latent attention (DeepSeek V2/V3) in its absorbed form on the attention kernels, in
the Metal simulator with the checkers on, against float64 reference math: E = 576 (512 latent
columns and 64 rotary ones), Ev = 512, one KV head (the latent cache) shared by 16 or 128 query
heads, and the value read from the key's own rows (STEEL_ATTN_FC_KV_ALIAS, attn::kv_alias).

Each case runs V as a prefix view of K (the alias: the kernel takes its V tile from the K tile
and never reads V's buffer) and V as a separate tensor of the same values (the general path);
both must match the oracle. Tolerances are attn_helpers.assert_attention_close's (out rounded
once from fp32 to its dtype, plus the fp32 score error bound for E = 576 terms).
"""

from __future__ import annotations

import pytest
import torch
from attn_helpers import (
    DTYPES,
    assert_attention_close,
    oracle,
    rand,
    requires_simulator,
    score_error,
    strict,
)

import torch_steel
from torch_steel import ops, sim

pytestmark = requires_simulator

E, EV = 576, 512
KV_ALIAS = 319  # STEEL_ATTN_FC_KV_ALIAS (shaders/steel/params.h)
# MLA's softmax scale comes from the model (qk_nope_head_dim + qk_rope_head_dim = 192 in
# DeepSeek-V2/V3, times a YaRN factor), not from the absorbed head dim 576.
SCALE = 192**-0.5 * 1.3


def latent(B, S, dtype, gen):
    """A latent cache [B, 1, S, 576] and V = its first 512 columns (a view)."""
    kv = rand(B, 1, S, E, dtype=dtype, gen=gen)
    return kv, kv[..., :EV]


def _inputs(q, k, v, kwargs):
    """sdpa_forward's inputs and options for torch_steel.sdpa's keywords (test_decode.py's)."""
    inputs, _ = ops.attention_ops._sdpa_inputs(q, k, v, None, 0.0, kwargs.pop("is_causal", False),
                                 kwargs.pop("scale", None), True, kwargs.pop("sinks", None),
                                 kwargs.pop("softcap", None), kwargs.pop("window", None),
                                 kwargs.pop("causal_align", "top_left"), None, 0)  # fmt: skip
    return inputs, ops.Attn(*inputs[4:])._replace(**kwargs)


def plan_of(q, k, v, **kwargs):
    inputs, attn = _inputs(q, k, v, kwargs)
    return sim.plan("sdpa", [*inputs[:4], attn.sinks], attn.run_options())


def forward(q, k, v, **kwargs):
    """(out, lse) of sdpa_forward on the sim backend (num_splits among the keywords)."""
    inputs, attn = _inputs(q, k, v, kwargs)
    with strict(), torch_steel.backend("sim"):
        return torch.ops.steel.sdpa_forward(*inputs[:4], *attn)


def run(q, k, v, **kwargs):
    with strict(), torch_steel.backend("sim"):
        return torch_steel.sdpa(q, k, v, return_lse=True, enable_gqa=True, **kwargs)


def check_both(q, kv, v, **kwargs):
    """V as a prefix view of K (alias) and as its own tensor: both against the oracle; returns
    the alias's output."""
    assert v.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    ref_out, ref_lse = oracle(q, kv, v, enable_gqa=True, **kwargs)
    err = score_error(q, kv, kwargs.get("scale"))
    v_max = float(v.double().abs().max())
    out = None
    for value in (v, v.clone()):
        o, lse = run(q, kv, value, **kwargs)
        assert_attention_close(o, lse, ref_out, ref_lse, q.dtype, v_max, err)
        out = o if out is None else out
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L,H,S", [(1, 16, 33), (4, 16, 95), (2, 128, 63), (3, 16, 31)])
def test_decode_over_a_latent_cache(L, H, S, dtype):
    """1..4 query tokens, 16 and 128 heads on one KV head, S % 32 in {1, 31}; the plan takes
    the alias for the view and not for the copy."""
    gen = torch.Generator().manual_seed(L * 1000 + H + S)
    kv, v = latent(1, S, dtype, gen)
    q = rand(1, H, L, E, dtype=dtype, gen=gen)
    assert plan_of(q, kv, v).dispatches[0].constants[KV_ALIAS]
    assert not plan_of(q, kv, v.clone()).dispatches[0].constants[KV_ALIAS]
    check_both(q, kv, v, scale=SCALE)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_split_k_and_options(num_splits):
    """Split-K partitions with the merge, every decode option at once: causal bottom-right
    (the query tokens are the cache's last), a window, sinks, softcap, the model's scale."""
    gen = torch.Generator().manual_seed(num_splits)
    kv, v = latent(2, 289, torch.bfloat16, gen)
    q = rand(2, 16, 2, E, dtype=torch.bfloat16, gen=gen)
    sinks = rand(16, dtype=torch.float32, gen=gen)
    kwargs = dict(scale=SCALE, is_causal=True, causal_align="bottom_right", window=(100, 0),
                  sinks=sinks, softcap=20.0)  # fmt: skip
    p = plan_of(q, kv, v, num_splits=num_splits, **kwargs)
    assert p.dispatches[0].grid[0] == num_splits and p.dispatches[0].constants[KV_ALIAS]
    ref_out, ref_lse = oracle(q, kv, v, enable_gqa=True, **kwargs)
    err = score_error(q, kv, SCALE)
    for value in (v, v.clone()):
        o, lse = forward(q, kv, value, num_splits=num_splits, **kwargs)
        assert_attention_close(o, lse, ref_out, ref_lse, q.dtype, float(v.abs().max()), err)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_prefill_bottom_right(dtype):
    """The prefill kernel (33 query rows, 16 heads): a chunk of new tokens at the end of the
    cache, causal aligned bottom-right, ragged S (S % 32 == 1)."""
    gen = torch.Generator().manual_seed(5)
    kv, v = latent(1, 97, dtype, gen)
    q = rand(1, 16, 33, E, dtype=dtype, gen=gen)
    p = plan_of(q, kv, v, is_causal=True, causal_align="bottom_right")
    assert p.dispatches[0].kernel.startswith(
        "steel_attention_"
        + {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]
    )
    assert p.dispatches[0].constants[KV_ALIAS]
    check_both(q, kv, v, scale=SCALE, is_causal=True, causal_align="bottom_right")


def test_a_value_offset_by_one_column_takes_the_general_path():
    """V = K's columns 1..512 (not a prefix): the plan must not alias it, and the answer is V's
    own (an alias would read columns 0..511)."""
    gen = torch.Generator().manual_seed(9)
    kv = rand(1, 1, 65, E, dtype=torch.float16, gen=gen)
    v = kv[..., 1 : EV + 1]
    q = rand(1, 16, 1, E, dtype=torch.float16, gen=gen)
    assert not plan_of(q, kv, v).dispatches[0].constants[KV_ALIAS]
    check_both(q, kv, v, scale=SCALE)


def test_head_dims_between_instantiations():
    """E, Ev up to 576 on the next instantiation with bounded loads: 520/520 on e576_v576,
    576/500 on e576_v512 (aliased, Ev < the kernel's DV), 544/544 prefill."""
    gen = torch.Generator().manual_seed(3)
    for e, ev, L in [(520, 520, 2), (576, 500, 1), (544, 544, 40)]:
        kv = rand(1, 2, 45, e, dtype=torch.float16, gen=gen)
        q = rand(1, 4, L, e, dtype=torch.float16, gen=gen)
        check_both(q, kv, kv[..., :ev], scale=0.05)


def paged_latent(used, page_size, dtype, gen, spare=2):
    need = [-(-n // page_size) for n in used]
    pages = sum(need) + spare
    pool = rand(pages, page_size, 1, E, dtype=dtype, gen=gen)
    order = torch.randperm(pages, generator=gen).tolist()
    table = torch.full((len(used), max(need)), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(order[at : at + n], dtype=torch.int32)
        at += n
    return pool, table


def gather(pool, table, b, n):
    """Sequence b's latent rows from its pages, [1, 1, n, 576] (the test's own gather)."""
    rows = [pool[int(table[b, j // pool.shape[1]]), j % pool.shape[1]] for j in range(n)]
    return torch.stack(rows).transpose(0, 1).unsqueeze(0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_latent_cache(dtype):
    """A paged latent pool (vLLM's MLA layout: [pages, page_size, 1, 576], V its first 512
    columns), decode and a chunked-prefill sequence, causal bottom-right, one pass and split."""
    gen = torch.Generator().manual_seed(11)
    lq, used = [1, 4, 33], [17, 129, 95]
    pool, table = paged_latent(used, 16, dtype, gen)
    q = rand(sum(lq), 16, E, dtype=dtype, gen=gen)
    cu = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(used, dtype=torch.int32)
    kwargs = dict(scale=SCALE, is_causal=True, causal_align="bottom_right")
    p = sim.plan(
        "sdpa_varlen",
        [q, pool, pool[..., :EV], cu, None, None, table, seq],
        {"max_seqlen_q": max(lq), "max_seqlen_k": max(used), "scale": SCALE},
    )
    assert p.ok and p.dispatches[0].constants[KV_ALIAS], p.reason
    outs, lses = [], []
    for b, n in enumerate(used):
        qs = q[cu[b] : cu[b + 1]].transpose(0, 1).unsqueeze(0)
        ks = gather(pool, table, b, n)
        o, lse = oracle(qs, ks, ks[..., :EV], enable_gqa=True, **kwargs)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    ref_out, ref_lse = torch.cat(outs), torch.cat(lses, dim=1)
    err = score_error(q.transpose(0, 1), pool.reshape(-1, 1, E).transpose(0, 1), SCALE)
    for value in (pool[..., :EV], pool[..., :EV].clone()):
        for num_splits in (1, 2):
            with strict(), torch_steel.backend("sim"):
                out, lse = torch_steel.sdpa_varlen(q, pool, value, cu, None, max(lq), max(used),
                                                   block_table=table, seqused_k=seq,
                                                   num_splits=num_splits, return_lse=True,
                                                   **kwargs)  # fmt: skip
            assert_attention_close(out, lse, ref_out, ref_lse, dtype, float(pool.abs().max()),
                                   err)  # fmt: skip


def test_alias_reads_the_latent_once_per_block():
    """The simulator's counters: with the alias, V's buffer is never read and K's bytes equal
    the cache's size once per threadgroup block of heads (16 heads x 1 token: one block); the
    general path reads the 512 value columns again (1.89x)."""
    gen = torch.Generator().manual_seed(1)
    S = 257
    kv, v = latent(1, S, torch.float16, gen)
    q = rand(1, 16, 1, E, dtype=torch.float16, gen=gen)
    inputs = [q, kv, v, None, None]
    opts = {"scale": SCALE, "num_splits": 1}
    _, counters = sim.run_op("sdpa", inputs, opts, counters=True)
    (c,) = counters
    cache = kv.numel() * kv.element_size()
    assert c["buffers"][1]["read"] == cache and c["buffers"][2]["read"] == 0
    _, counters = sim.run_op("sdpa", [q, kv, v.clone(), None, None], opts, counters=True)
    (c,) = counters
    kv_bytes = c["buffers"][1]["read"] + c["buffers"][2]["read"]
    assert kv_bytes == cache * (E + EV) // E  # 1.89x
    # 128 heads: four blocks of 32 packed rows, each reading the latent once.
    q = rand(1, 128, 1, E, dtype=torch.float16, gen=gen)
    _, counters = sim.run_op("sdpa", [q, kv, v, None, None], opts, counters=True)
    assert counters[0]["threadgroups"] == 4
    assert counters[0]["buffers"][1]["read"] == 4 * cache
    assert counters[0]["buffers"][2]["read"] == 0


def test_m5_keeps_576_on_the_simdgroup_kernels_with_the_alias():
    """On an M5 (Metal 4, Apple10, the tensor-op library) the matmul2d prefill is instantiated
    for equal head-dim pairs 64 to 256 only (attn::tensor_serves), so absorbed MLA's 576 / 512
    plans the simdgroup prefill and decode kernels there as elsewhere, with the alias (which
    the matmul2d kernels would not take: attn::kv_alias); both paths agree with the oracle."""
    from gemm_helpers import M5

    gen = torch.Generator().manual_seed(8)
    kv, v = latent(1, 97, torch.bfloat16, gen)
    with sim.device(M5):
        for L in (33, 2):
            q = rand(1, 16, L, E, dtype=torch.bfloat16, gen=gen)
            (d, *_) = plan_of(q, kv, v, is_causal=True, causal_align="bottom_right").dispatches
            kind = "steel_attention_bf16_" if L > 8 else "steel_attention_decode_bf16_"
            assert d.kernel == kind + "e576_v512" and d.constants[KV_ALIAS], d.kernel
            check_both(q, kv, v, scale=SCALE, is_causal=True, causal_align="bottom_right")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_prefill_alias_where_the_v_tile_is_fp32(dtype):
    """The alias on a prefill instantiation whose own V tile is fp32 (e64_v64 at 16-bit dtypes,
    params.h steel_attn_prefill_v_f32): P V then reads the K tile in the inputs' dtype, not the
    fp32 V tile, which holds nothing. E = 64 with V its first 40 columns, L = 40 and S = 33 (a
    ragged last key tile), causal; both paths against the oracle."""
    gen = torch.Generator().manual_seed(64)
    kv = rand(1, 2, 33, 64, dtype=dtype, gen=gen)
    v = kv[..., :40]
    q = rand(1, 4, 40, 64, dtype=dtype, gen=gen)
    (d,) = plan_of(q, kv, v, is_causal=True).dispatches
    assert d.kernel.endswith("_e64_v64") and d.constants[KV_ALIAS], d.kernel
    check_both(q, kv, v, scale=0.125, is_causal=True)


def absorbed_deepseek_layer():
    """One DeepSeek-V2 attention layer of a tiny config built in code (random weights, float64,
    YaRN rope so that its scale carries the mscale factor), a 37-token input, the layer's own
    attention output per head (the input of o_proj, [1, T, H, v_head_dim]), and what steel
    needs to compute it absorbed: the query [1, H, T, 576], the latent cache [1, 1, T, 576],
    W_UV [H, v_head_dim, 512] and the layer's scale."""
    ds = pytest.importorskip("transformers.models.deepseek_v2.modeling_deepseek_v2")
    from transformers import DeepseekV2Config

    H, nope, rope, v_dim, rank, T = 16, 32, 64, 24, 512, 37
    config = DeepseekV2Config(
        hidden_size=64, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=None,
        kv_lora_rank=rank, qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=v_dim,
        num_hidden_layers=1, intermediate_size=64, moe_intermediate_size=16, vocab_size=32,
        max_position_embeddings=256, attn_implementation="sdpa",
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0,
                         "mscale": 1.0, "original_max_position_embeddings": 64,
                         "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1},
    )  # fmt: skip
    torch.manual_seed(0)
    layer = ds.DeepseekV2Attention(config, layer_idx=0).double().eval()
    x = torch.randn(1, T, config.hidden_size, dtype=torch.float64)
    freqs = ds.DeepseekV2RotaryEmbedding(config)(x, torch.arange(T)[None])
    seen = {}
    hook = layer.o_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("o", a[0]))
    with torch.no_grad():
        layer(x, attention_mask=None, position_embeddings=freqs)  # causal (sdpa, no mask)
        hook.remove()
        # The absorbed form from the layer's weights: q_nope W_UK against the normalised latent
        # c, q_pe against the shared rotary key, and the value c itself (W_UV after).
        q = layer.q_proj(x).view(1, T, H, nope + rope).transpose(1, 2)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        c, k_pe = layer.kv_a_proj_with_mqa(x).split([rank, rope], dim=-1)
        c = layer.kv_a_layernorm(c).view(1, 1, T, rank)
        q_pe, k_pe = ds.apply_rotary_emb(q_pe, k_pe.view(1, 1, T, rope), freqs)
        w = layer.kv_b_proj.weight.view(H, nope + v_dim, rank)
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        query = torch.cat([q_nope @ w_uk, q_pe], dim=-1)
        cache = torch.cat([c, k_pe], dim=-1)
    return seen["o"].view(1, T, H, v_dim), query, cache, w_uv, layer.scaling


@pytest.mark.parametrize("backend", ["reference", "sim"])
def test_deepseek_v2_layer_absorbed(backend):
    """The worked example (README, Attention): absorbed MLA through steel equals a transformers
    DeepSeek-V2 layer's own (non-absorbed) attention, for the whole causal prompt (prefill
    kernel) and for its last 3 tokens as a decode step over the latent cache (bottom-right).
    Tolerances: the reference backend runs in float64 (a few ulps of float64 after the
    reassociation: 1e-12 relative to max |out|); the simulator in float32, where rounding the
    inputs and 576-term scores to fp32 (2^-24 relative, times sqrt(576) for the dot products
    and the softmax's sensitivity of a few units) stays below 1e-5 relative (seen: 1e-7)."""
    ref, query, cache, w_uv, scale = absorbed_deepseek_layer()
    assert abs(scale - 576**-0.5) > 0.05  # the model's scale, not the absorbed head dim's
    dtype, rel = (torch.float64, 1e-12) if backend == "reference" else (torch.float32, 1e-5)
    q, kv = query.to(dtype), cache.to(dtype)
    with strict(), torch_steel.backend(backend):
        prompt = torch_steel.sdpa(q, kv, kv[..., :512], is_causal=True, scale=scale,
                                  enable_gqa=True)  # fmt: skip
        step = torch_steel.sdpa(q[:, :, -3:], kv, kv[..., :512], is_causal=True, scale=scale,
                                causal_align="bottom_right", enable_gqa=True)  # fmt: skip
    bound = rel * float(ref.abs().max())
    for out, want in [(prompt, ref), (step, ref[:, -3:])]:
        heads = (out.double() @ w_uv.transpose(-1, -2)).transpose(1, 2)  # [1, T, H, v_head_dim]
        assert float((heads - want).abs().max()) <= bound
    if backend == "sim":
        inputs, attn = _inputs(
            q[:, :, -3:],
            kv,
            kv[..., :512],
            dict(scale=scale, is_causal=True, causal_align="bottom_right"),
        )
        p = sim.plan("sdpa", [*inputs[:4], attn.sinks], attn.run_options())
        assert p.dispatches[0].kernel.startswith("steel_attention_decode_f32_e576_v512")
        assert p.dispatches[0].constants[KV_ALIAS]
