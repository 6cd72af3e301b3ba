#!/usr/bin/env python3
"""Writes the K-quant fixtures of `tpctl-checkpoint` and `tpctl`: blocks quantized by llama.cpp's own
quantizer, with the values gguf-py dequantizes them to.

The Rust tests (`crates/checkpoint/tests/kquant.rs`, `crates/cli/tests/kquant.rs`) read these
files and need neither llama.cpp nor Python; this script only refreshes them:

    python3 scripts/kquant_fixtures.py [--out DIR]

Needs `llama_cpp` (llama-cpp-python: its `libggml-base.so` provides `ggml_quantize_chunk`, the
quantizer llama.cpp uses for every type, and `llama_model_quantize`) and `gguf` (gguf-py,
llama.cpp's Python package, `pip install gguf numpy`: `gguf.quants.dequantize` is the
independent reference for the values).

It writes, under `--out` (default `crates/checkpoint/tests/fixtures/kquant`):

- `blocks.gguf`: for each type in `TYPES`, a tensor named after the type (`q4_k`) of
  `ROWS` rows of 256 random values (rows of different scales: normal, wide, tiny enough for
  subnormal f16 scales, and all positive) quantized by `ggml_quantize_chunk`, and next to it
  `q4_k.want`, the f32 values `gguf.quants.dequantize` gives for those bytes.
- `tiny-Q4_K_M.gguf`: a random two-layer Llama (hidden 256, FFN 256, 4 query and 2 KV heads of
  64, a BPE vocabulary of 32 tokens; weights uniform in ±4/√cols, large enough that greedy
  decoding wanders instead of repeating one token) written in f32 and quantized to Q4_K_M by
  `llama_model_quantize` (every row a whole number of 256-element super-blocks: Q4_K and Q6_K
  tensors).
- `tiny-Q4_K_M-odd.gguf`: the same with hidden 160, one layer: rows of 160 are not whole
  super-blocks, so llama.cpp falls back to Q5_0 (and Q8_0 for Q6_K) for them, as it does
  for SmolLM2 (hidden 576); only the FFN down projection (rows of 256) is Q4_K or Q6_K.
- `tiny-Q4_K_M.json`, `tiny-Q4_K_M-odd.json`: per tensor, its GGML type name and the FNV-1a
  64-bit hash (hex) of the little-endian f32 bytes gguf-py dequantizes it to.

It also prints, per type, whether ggml's own `dequantize_row_*` (compiled C) gives the same
bits as gguf-py, so a difference between the two references would show here.
"""

import argparse
import ctypes
import json
import os
import pathlib
import sys
import tempfile

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
import llama_cpp

TYPES = [T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
ROWS = 4
COLS = 256


def ggml_lib() -> ctypes.CDLL:
    lib_dir = pathlib.Path(llama_cpp.__file__).parent / "lib"
    lib = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
    ]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    return lib


def ggml_quantize(lib: ctypes.CDLL, qtype: T, x: np.ndarray) -> np.ndarray:
    """llama.cpp's quantizer (no importance matrix) on the rows of `x`."""
    assert not lib.ggml_quantize_requires_imatrix(int(qtype)), qtype.name
    lib.ggml_quantize_init(int(qtype))
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = x.shape
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    out = np.zeros((rows, cols // block * size), dtype=np.uint8)
    n = lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, cols, None)
    assert n == out.nbytes, (qtype.name, n, out.nbytes)
    return out


def ggml_dequantize(lib: ctypes.CDLL, qtype: T, q: np.ndarray, n: int):
    """ggml's own `dequantize_row_<type>`, or None when the library does not export it."""
    try:
        f = getattr(lib, f"dequantize_row_{qtype.name.lower().replace('_k', '_K')}")
    except AttributeError:
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    q = np.ascontiguousarray(q)
    out = np.zeros(n, dtype=np.float32)
    f(q.ctypes.data, out.ctypes.data, n)
    return out


def test_rows(rng: np.random.Generator) -> np.ndarray:
    return np.stack([
        rng.normal(0.0, 1.0, COLS),
        rng.normal(0.0, 1.0, COLS) * np.exp(rng.normal(0.0, 2.0, COLS)),
        rng.normal(0.0, 1e-6, COLS),
        np.abs(rng.normal(0.5, 1.0, COLS)),
    ]).astype(np.float32)


def write_blocks(lib: ctypes.CDLL, out: pathlib.Path) -> None:
    rng = np.random.default_rng(20240611)
    w = gguf.GGUFWriter(str(out / "blocks.gguf"), "kquant-fixtures")
    for qtype in TYPES:
        x = test_rows(rng)
        q = ggml_quantize(lib, qtype, x)
        want = gguf.quants.dequantize(q, qtype).astype(np.float32)
        assert want.shape == (ROWS, COLS)
        c = ggml_dequantize(lib, qtype, q, ROWS * COLS)
        same = "not exported" if c is None else (
            "same bits" if c.view(np.uint32).tolist() == want.ravel().view(np.uint32).tolist()
            else f"{int(np.sum(c.view(np.uint32) != want.ravel().view(np.uint32)))} values differ")
        err = np.max(np.abs(want - x), axis=1) / np.max(np.abs(x), axis=1)
        print(f"{qtype.name}: {q.nbytes} bytes, error / row max per row "
              f"{', '.join(f'{e:.2g}' for e in err)}; ggml's dequantize_row vs gguf-py: {same}")
        name = qtype.name.lower()
        w.add_tensor(name, q, raw_dtype=qtype)
        w.add_tensor(f"{name}.want", want)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_f32_llama(path: str, hidden: int, ffn: int, layers: int, seed: int) -> None:
    heads, kv_heads, vocab = 4, 2, 32
    d = hidden // heads
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    # A byte-level BPE vocabulary closed under its merges (gguf-py drops an empty merge list,
    # and a BPE tokenizer needs one).
    digits = [str(i) for i in range(10)]
    tokens = ["t", *digits, *[f"t{d}" for d in digits], *"abcdefghijk"]
    assert len(tokens) == vocab
    w.add_token_list(tokens)
    w.add_token_merges([f"t {d}" for d in digits])
    w.add_eos_token_id(0)

    def matrix(name: str, rows: int, cols: int) -> None:
        scale = 4.0 / np.sqrt(cols)
        w.add_tensor(name, rng.uniform(-scale, scale, (rows, cols)).astype(np.float32))

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + rng.uniform(-0.2, 0.2, hidden)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden)
    for l in range(layers):
        norm(f"blk.{l}.attn_norm.weight")
        matrix(f"blk.{l}.attn_q.weight", heads * d, hidden)
        matrix(f"blk.{l}.attn_k.weight", kv_heads * d, hidden)
        matrix(f"blk.{l}.attn_v.weight", kv_heads * d, hidden)
        matrix(f"blk.{l}.attn_output.weight", hidden, heads * d)
        norm(f"blk.{l}.ffn_norm.weight")
        matrix(f"blk.{l}.ffn_gate.weight", ffn, hidden)
        matrix(f"blk.{l}.ffn_up.weight", ffn, hidden)
        matrix(f"blk.{l}.ffn_down.weight", hidden, ffn)
    norm("output_norm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def fnv1a64(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def write_model(out: pathlib.Path, stem: str, hidden: int, ffn: int, layers: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, "f32.gguf")
        write_f32_llama(f32, hidden, ffn, layers, seed=hidden)
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = 2
        dst = out / f"{stem}.gguf"
        rc = llama_cpp.llama_model_quantize(f32.encode(), str(dst).encode(), ctypes.byref(params))
        if rc != 0:
            sys.exit(f"llama_model_quantize failed ({rc})")
    reader = gguf.GGUFReader(str(dst))
    hashes = {}
    for t in reader.tensors:
        if t.tensor_type == T.F32:
            values = np.array(t.data, dtype=np.float32)
        else:
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        hashes[t.name] = {"type": t.tensor_type.name, "fnv1a64": fnv1a64(values.tobytes())}
    (out / f"{stem}.json").write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    types = sorted({h["type"] for h in hashes.values()})
    print(f"{dst.name}: {dst.stat().st_size} bytes, types {', '.join(types)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="crates/checkpoint/tests/fixtures/kquant")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_blocks(ggml_lib(), out)
    write_model(out, "tiny-Q4_K_M", hidden=256, ffn=256, layers=2)
    write_model(out, "tiny-Q4_K_M-odd", hidden=160, ffn=256, layers=1)


if __name__ == "__main__":
    main()
