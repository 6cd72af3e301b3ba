"""llama.cpp's logits at every position of one prompt, for `cargo xtask bench agree --random` to
compare tpctl's against on a random-weight file.

Usage: python3 llamacpp_logits.py MODEL.gguf ID...
Prints one JSON object: {"logits": [[...] per position]}. One batch holds the whole prompt,
every position's logits requested; keys and values are f32 and flash attention is off, as in
llamacpp_greedy.py (llama.cpp's CPU flash attention loses precision)."""
import json, sys
import numpy as np
import llama_cpp as L

path, ids = sys.argv[1], [int(i) for i in sys.argv[2:]]
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
if not model:
    sys.exit(f"llama.cpp could not load {path}")
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
cp = L.llama_context_default_params()
cp.n_ctx = max(64, len(ids))
cp.n_batch = cp.n_ubatch = max(64, len(ids))
cp.n_threads = cp.n_threads_batch = 2
cp.no_perf = True
cp.type_k = L.GGML_TYPE_F32
cp.type_v = L.GGML_TYPE_F32
cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
ctx = L.llama_init_from_model(model, cp)
batch = L.llama_batch_init(len(ids), 0, 1)
for j, t in enumerate(ids):
    batch.token[j] = t; batch.pos[j] = j; batch.n_seq_id[j] = 1; batch.seq_id[j][0] = 0
    batch.logits[j] = 1
batch.n_tokens = len(ids)
assert L.llama_decode(ctx, batch) == 0, "llama_decode failed"
rows = [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, j), shape=(n_vocab,)).tolist() for j in range(len(ids))]
print(json.dumps({"logits": rows}))
