"""End-to-end drift of a quantized KV cache (torch_steel.kv formats) on tiny random-weight Llamas.

Two models built from transformers configs (no downloads; random weights, seed 0, transformers'
default initializer_range 0.02): MHA and GQA, head dim 128 so that every format applies. Each
runs attn_implementation="steel" on torch_steel's CPU reference backend (the quantized path
dequantizes each K/V value into the query's dtype and computes the fp16 path's math in float32,
as the kernels do; the figures are the formats' numerics, not the simulator's or a GPU's).

The baseline is the unquantized cache, a transformers DynamicCache in the model's dtype
(float16 by default): a prompt of --prompt tokens, then --new greedy decode steps, one token at
a time. Each format's QuantizedKVCache (fp16 scales, the same format on K and V) is fed the
baseline's tokens (teacher forcing, so the steps compare logits of the same context), and
reports over all positions (prompt and decode):

max |dl|   the largest |logit - baseline logit|;
/ range    that over the baseline's logit range (max - min) at the same position, the largest;
top-1      the share of positions whose argmax equals the baseline's;
free run   greedy decode on its own tokens: steps equal to the baseline's before the first
           different token (of --new).

The first position's logits do not depend on the key format: its query sees one key, whose
softmax weight is 1 whatever the key is (the test checks this exactly).

python bench/bench_kv_model.py [--prompt 16] [--new 48] [--dtype float16]
"""

import argparse

import torch

import torch_steel
import torch_steel.hf

FORMATS = ["int8", "int8_g32", "int8_g64", "int8_g128", "q4_g32", "q4_g64"]
MODELS = {"MHA": 8, "GQA": 2}  # KV heads of 8 query heads


def tiny_llama(kv_heads, heads=8, head_dim=128, hidden=256, layers=2, vocab=512,
               dtype=torch.float16, seed=0):  # fmt: skip
    """A random-weight LlamaForCausalLM (eval, attn_implementation="steel")."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    model.set_attn_implementation(torch_steel.hf.register())
    return model


def decode(model, prompt, n_new, cache, forced=None):
    """Logits [prompt + n_new - 1, vocab] (float64) and tokens [prompt + n_new] of a prefill
    and one-token decode steps; the next token is `forced`'s (teacher forcing) or the argmax."""
    ids = prompt
    out = model(ids, cache=cache, use_cache=True)
    logits = [out.logits[0]]
    for t in range(n_new - 1):
        nxt = logits[-1][-1].argmax() if forced is None else forced[prompt.shape[1] + t]
        ids = torch.cat([ids, nxt.view(1, 1)], 1)
        out = model(ids[:, -1:], cache=cache, use_cache=True)
        logits.append(out.logits[0])
    last = logits[-1][-1].argmax() if forced is None else forced[-1]
    return torch.cat(logits).double(), torch.cat([ids[0], last.view(1)])


def drift(model, prompt, n_new, formats, v_formats=None):
    """{format: figures} of each format's cache against the DynamicCache baseline (the module
    docstring), plus "logits" of each (to check invariants). v_formats: the value formats, by
    default each format on K and V."""
    from transformers import DynamicCache

    v_formats = v_formats or formats
    with torch.no_grad(), torch_steel.backend("reference"):
        base, tokens = decode(model, prompt, n_new, DynamicCache())
        rows = {}
        for kf, vf in zip(formats, v_formats):
            caches = [torch_steel.hf.quantized_cache(k_format=kf, v_format=vf) for _ in range(2)]
            logits, _ = decode(model, prompt, n_new, caches[0], forced=tokens)
            _, free = decode(model, prompt, n_new, caches[1])
            d = (logits - base).abs()
            span = base.amax(-1) - base.amin(-1)
            new = free[prompt.shape[1] :] != tokens[prompt.shape[1] :]
            rows[(kf, vf)] = {
                "max_abs": float(d.max()),
                "rel_range": float((d.amax(-1) / span).max()),
                "top1": float((logits.argmax(-1) == base.argmax(-1)).double().mean()),
                "free_run": int(new.nonzero()[0, 0]) if new.any() else n_new,
                "logits": logits,
            }
    return base, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    print(f"tiny random-weight Llamas (2 layers, 8 heads, head dim 128, hidden 256, vocab 512, "
          f"{a.dtype}); prompt {a.prompt} + {a.new} greedy tokens; steel attention on the CPU "
          "reference backend; fp16 scales; against the unquantized DynamicCache")  # fmt: skip
    for name, kv_heads in MODELS.items():
        model = tiny_llama(kv_heads, dtype=dtype)
        prompt = torch.randint(0, 512, (1, a.prompt), generator=torch.Generator().manual_seed(1))
        base, rows = drift(model, prompt, a.new, FORMATS)
        span = float((base.amax(-1) - base.amin(-1)).mean())
        print(f"\n{name} (8 query heads, {kv_heads} KV heads); baseline logit range {span:.3f} "
              "(mean over positions)")  # fmt: skip
        print(f"{'format':10} {'max |dl|':>9} {'/ range':>8} {'top-1':>6} {'free run':>9}")
        for (fmt, _), r in rows.items():
            print(f"{fmt:10} {r['max_abs']:9.2e} {r['rel_range']:8.2e} {r['top1']:6.1%} "
                  f"{r['free_run']:5d}/{a.new}")  # fmt: skip


if __name__ == "__main__":
    main()
