"""llama.cpp's greedy continuation of prompts, with each chosen token's log-probability and the
margin between the two best logits, for `cargo xtask bench agree` to compare tpctl against.

Usage: python3 llamacpp_greedy.py MODEL.gguf THREADS N_PROMPTS PROMPT_TOKENS DECODE_TOKENS
Prints one JSON object: {"prompts": [[ids]], "runs": [{"ids": [...], "logprobs": [...],
"margins": [...]}]}; a continuation stops after an end-of-generation token, as tpctl run does.
The prompts are the first PROMPT_TOKENS tokens of fixed English and code texts. The KV cache is
f32, as tpctl's, and flash attention is off: llama.cpp's CPU flash attention loses precision (on
the f32 SmolLM2 its chosen-token log-probabilities are up to 7e-3 away from an f64 forward of the
same file, scripts/f64_forward.py, against 3e-6 without it). With quantized weights llama.cpp
still rounds activations to 8 bits for its dot products, which tpctl does not."""
import json, sys
import numpy as np
import llama_cpp as L

path, threads, n_prompts, n_prompt, n_dec = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
vocab = L.llama_model_get_vocab(model)
n_vocab = L.llama_vocab_n_tokens(vocab)
cp = L.llama_context_default_params()
cp.n_ctx = n_prompt + n_dec + 16
cp.n_batch = max(512, n_prompt)
cp.n_ubatch = cp.n_batch
cp.n_threads = threads
cp.n_threads_batch = threads
cp.no_perf = True
# Keys and values in f32, as tpctl keeps them (llama.cpp's default is f16).
cp.type_k = L.GGML_TYPE_F32
cp.type_v = L.GGML_TYPE_F32
# The plain attention path: its softmax and products are f32 throughout (see above).
cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
ctx = L.llama_init_from_model(model, cp)

texts = ["The quick brown fox jumps over the lazy dog. ", "Once upon a time there was a small village by the sea. ",
         "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
         "The history of the Roman Empire spans many centuries. ", "Water is made of hydrogen and oxygen atoms. ",
         "In mathematics, a prime number is a natural number greater than one. ",
         "The capital of France is Paris, and the capital of Italy is Rome. ", "Machine learning models learn from data. ",
         "Photosynthesis turns light, water and carbon dioxide into sugar. ", "SELECT name, age FROM users WHERE age > 30;\n",
         "The mitochondria is the powerhouse of the cell. ", "Rust guarantees memory safety without garbage collection. ",
         "A journey of a thousand miles begins with a single step. ", "Tokyo is the most populous metropolitan area in the world. ",
         "for i in range(10):\n    print(i * i)\n", "The speed of light in vacuum is about 299,792 kilometres per second. "]

def tok(s):
    b = s.encode(); buf = (L.llama_token * 8192)()
    n = L.llama_tokenize(vocab, b, len(b), buf, 8192, False, True)
    return list(buf[:n])

prompts = [tok(texts[i % len(texts)] * 64)[:n_prompt] for i in range(n_prompts)]

def decode(tokens, start):
    batch = L.llama_batch_init(len(tokens), 0, 1)
    for j, t in enumerate(tokens):
        batch.token[j] = t; batch.pos[j] = start + j; batch.n_seq_id[j] = 1; batch.seq_id[j][0] = 0
        batch.logits[j] = 1 if j == len(tokens) - 1 else 0
    batch.n_tokens = len(tokens)
    assert L.llama_decode(ctx, batch) == 0
    L.llama_batch_free(batch)
    return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, len(tokens) - 1), shape=(n_vocab,)).astype(np.float64)

runs = []
for p in prompts:
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    logits = decode(p, 0)
    ids, logprobs, margins = [], [], []
    for step in range(n_dec):
        best = int(logits.argmax())
        top2 = np.partition(logits, -2)[-2:]
        lse = logits.max() + np.log(np.exp(logits - logits.max()).sum())
        ids.append(best); logprobs.append(float(logits[best] - lse)); margins.append(float(top2[1] - top2[0]))
        if L.llama_vocab_is_eog(vocab, best) or step == n_dec - 1:
            break
        logits = decode([best], len(p) + step)
    runs.append({"ids": ids, "logprobs": logprobs, "margins": margins})
print(json.dumps({"prompts": prompts, "runs": runs}))
