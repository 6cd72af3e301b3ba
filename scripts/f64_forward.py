"""An f64 forward pass of a Llama-family GGUF (numpy and gguf-py only; quantized tensors are
dequantized by gguf-py, so the weights are exactly the values both implementations use): the
exact answer that both tpctl and llama.cpp approximate in f32, to tell which of the two drifts
when their log-probabilities differ.

Usage: python3 f64_forward.py MODEL.gguf PROMPTS.json DECODE_TOKENS
PROMPTS.json is a list of token-id lists (llamacpp_greedy.py prints one under "prompts"). Prints
[{"ids": [...], "logprobs": [...], "margins": [...]}] per prompt: the greedy continuation, each
chosen token's log-probability and the gap between the two best logits. Adjacent-pair rotary embedding (GGUF's Q/K order), grouped-query attention, tied
output embedding when output.weight is absent; no rope scaling, biases or other architectures.
Measured 2026-12-01 on the f32 SmolLM2-135M, 4 prompts x 32 tokens: tpctl serve within 1e-5 of
it, llama.cpp within 3e-6 without flash attention and 7e-3 with it."""
import sys, json, numpy as np, gguf
path, prompt_json, n_dec = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = gguf.GGUFReader(path)
kv = {f.name: f for f in r.fields.values()}
def val(k):
    f = kv[k]; return f.parts[f.data[0]].tolist()[0] if len(f.data) == 1 else None
L = val('llama.block_count'); H = val('llama.attention.head_count'); KVH = val('llama.attention.head_count_kv')
eps = val('llama.attention.layer_norm_rms_epsilon'); base = val('llama.rope.freq_base')
def values(t):
    """A tensor's values as f64, shaped [rows, cols]: quantized types through gguf-py's own
    dequantization (the values llama.cpp multiplies)."""
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.array(t.data, dtype=np.float64)
    return np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64)
T = {t.name: values(t) for t in r.tensors}
emb = T['token_embd.weight']; D = emb.shape[1]; hd = D // H
out_w = T.get('output.weight', emb)
def rms(x, w): return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
inv = base ** (-np.arange(0, hd, 2) / hd)
def rope(x, pos):  # x: (n, heads, hd), adjacent pairs
    ang = pos[:, None] * inv[None, :]; c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]; y = np.empty_like(x)
    y[..., 0::2] = a * c - b * s; y[..., 1::2] = a * s + b * c; return y
def forward(ids, cache):
    start = cache['n']; n = len(ids); pos = np.arange(start, start + n, dtype=np.float64)
    x = emb[ids]
    for l in range(L):
        p = f'blk.{l}.'
        h = rms(x, T[p + 'attn_norm.weight'])
        q = (h @ T[p + 'attn_q.weight'].T).reshape(n, H, hd); k = (h @ T[p + 'attn_k.weight'].T).reshape(n, KVH, hd)
        v = (h @ T[p + 'attn_v.weight'].T).reshape(n, KVH, hd)
        q, k = rope(q, pos), rope(k, pos)
        K = cache.setdefault(('k', l), np.zeros((0, KVH, hd))); V = cache.setdefault(('v', l), np.zeros((0, KVH, hd)))
        K = np.concatenate([K, k]); V = np.concatenate([V, v]); cache[('k', l)] = K; cache[('v', l)] = V
        g = H // KVH; o = np.empty((n, H, hd))
        for hh in range(H):
            s = q[:, hh, :] @ K[:, hh // g, :].T / np.sqrt(hd)
            mask = np.arange(K.shape[0])[None, :] > (start + np.arange(n))[:, None]
            s[mask] = -np.inf; s -= s.max(-1, keepdims=True); w = np.exp(s); w /= w.sum(-1, keepdims=True)
            o[:, hh, :] = w @ V[:, hh // g, :]
        x = x + o.reshape(n, D) @ T[p + 'attn_output.weight'].T
        h = rms(x, T[p + 'ffn_norm.weight'])
        a = h @ T[p + 'ffn_gate.weight'].T; b = h @ T[p + 'ffn_up.weight'].T
        x = x + (a / (1 + np.exp(-a)) * b) @ T[p + 'ffn_down.weight'].T
    cache['n'] = start + n
    return rms(x[-1], T['output_norm.weight']) @ out_w.T
prompts = json.load(open(prompt_json))
res = []
for p in prompts:
    cache = {'n': 0}; lg = forward(np.array(p), cache); ids, lps, margins = [], [], []
    for step in range(n_dec):
        b = int(lg.argmax()); lse = lg.max() + np.log(np.exp(lg - lg.max()).sum())
        top2 = np.partition(lg, -2)[-2:]
        ids.append(b); lps.append(float(lg[b] - lse)); margins.append(float(top2[1] - top2[0]))
        if step == n_dec - 1: break
        lg = forward(np.array([b]), cache)
    res.append({"ids": ids, "logprobs": lps, "margins": margins})
print(json.dumps(res))
