#!/usr/bin/env python3
"""Records llama.cpp's token ids for the GGUF tokenizer tests of `tpctl-text`.

The Rust test `crates/text/tests/gguf_tokenizers.rs` rebuilds each tokenizer below and checks
that `Tokenizer::encode` gives the ids llama.cpp gave here, for every string of an awkward
corpus (digits, emoji, CJK, code, whitespace runs, special tokens). llama.cpp is not needed to
run that test, only to refresh its fixture, which is this script's job:

    python3 scripts/tokenizer_fixtures.py [--model PATH] [--out DIR]

Needs `llama_cpp` (llama-cpp-python; the ids come from its `vocab_only` loader, with
`add_bos=True, special=True`, which is what `Tokenizer::encode` does) and `gguf` (the
`gguf` package of llama.cpp's repository, `pip install gguf`). The default model is the one
`cargo xtask fetch-model` caches: SmolLM2-135M-Instruct Q4_1.

It writes, under `--out` (default `crates/text/tests/fixtures/tokenizer`):

- `bpe-vocab.gguf`: a vocabulary-only GGUF with the first 8192 tokens of SmolLM2 and the
  merges that build them (a byte-level BPE closed under its merges), without
  `tokenizer.ggml.add_bos_token`, so each pre-tokenizer's own BOS default shows;
- `spm-vocab.gguf`: a SentencePiece (`tokenizer.ggml.model` = `llama`) vocabulary made from
  the same tokens: byte-level pieces turned back into text, spaces written `▁`, scored by
  their merge order, with `<unk>`, `<s>`, `</s>` and the 256 `<0xNN>` byte tokens first;
- `ids.json`: the corpus and, per case (a vocabulary plus metadata overrides such as
  `tokenizer.ggml.pre`), llama.cpp's ids for every string; for SentencePiece cases also
  llama.cpp's `llama_detokenize` of those ids, with and without special tokens.

The cases cover every `tokenizer.ggml.pre` tag in `PRE_TAGS` on the small BPE vocabulary and
on the default model's full vocabulary (`"vocab": "default-model"`; the Rust test skips
those when the model is not cached), and SentencePiece with and without
`tokenizer.ggml.add_space_prefix`.
"""

import argparse
import ctypes
import json
import os
import sys
import tempfile

import gguf
import llama_cpp

DEFAULT_MODEL = os.path.expanduser("~/.cache/tpctl/models/SmolLM2-135M-Instruct.Q4_1.gguf")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "crates", "text", "tests", "fixtures", "tokenizer")

# A tag of each pre-tokenizer family `Tokenizer::from_gguf` supports, and the aliases the issue
# names (aliases share their family's regexes; the Rust unit tests check that each resolves).
PRE_TAGS = [
    "default",
    "gpt-2",
    "mpt",
    "olmo",
    "smollm",
    "starcoder",
    "refact",
    "command-r",
    "llama-bpe",
    "dbrx",
    "chatglm-bpe",
    "qwen2",
    "stablelm2",
    "qwen35",
    "minicpm5",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
    "falcon",
    "poro-chat",
    "viking",
    "tekken",
    "gpt-4o",
    "bailingmoe",
    "seed-coder",
    "exaone-moe",
    "ufakzeka",
    "jais-2",
]

BPE_TOKENS = 8192

CORPUS = [
    "",
    "Hello world",
    " ",
    "   ",
    "\n",
    "\n\n\n",
    "\t\tx",
    "   leading and trailing   ",
    "a  b   c    d",
    "x \n y \r\n z\r\r\n",
    "1234567890",
    "3.14159 and 2,718,281 or 1_000_000",
    "Call 555-0199 x12, room 42b",
    "٣٤٥ ²³ ½ Ⅻ ①",
    "🦀 Rust 🚀🚀 ❤️ 👨‍👩‍👧‍👦",
    "中文测试，你好世界。",
    "日本語のテキスト、カタカナ",
    "한국어 텍스트",
    "fn main() {\n    println!(\"{}\", x + 1);\n}\n",
    "def f(x):\n\treturn x**2  # comment",
    "if (a<=b && c!=d) { return a->b; } // ok",
    "I'm you'll they've she'd IT'S We'RE don't 'quoted'",
    "héllo wörld café naïve Ærøskøbing",
    "Ελληνικά Русский العربية עברית हिन्दी \u212aelvin \u2126hm",
    "e\u0301 n\u0303 \u01c5ungla \u03a9mega \u00b5 ﬁ",
    "\u00a0nbsp\u3000ideographic\u2003em\u200bzero",
    "tab\tsep\x0bvt\x0cff\x1cfs\x85nel",
    "\x00\x01\x7f",
    "URL: https://example.com/a?b=c&d=e#f e-mail: a.b@c.io",
    "MixedCASE camelCase snake_case SCREAMING_CASE HTTPServer",
    "aaaaaaaaaaaaaaaaaaaa !!!!!!????... 1111111111",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "▁literal ▁ lower-block",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>a b",
    " <|im_end|> spaced <|im_start|>",
    "<s>Hello</s> <unk> <0x41>",
]


def field_value(field):
    """The Python value and the GGUF value types of a reader field."""
    types = field.types
    value = field.contents()
    if types[0] == gguf.GGUFValueType.ARRAY:
        return value, types[0], types[-1]
    return value, types[0], None


def write_vocab(path, fields):
    """A vocabulary-only GGUF with `fields`: key -> (value, type, sub_type)."""
    writer = gguf.GGUFWriter(path, arch="llama")
    for key, (value, vtype, sub_type) in fields.items():
        if key == "general.architecture":
            continue
        writer.add_key_value(key, value, vtype, sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tokenizer_fields(model_path):
    reader = gguf.GGUFReader(model_path)
    return {k: field_value(f) for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def small_bpe(full):
    """The first `BPE_TOKENS` tokens of the full vocabulary and the merges that build them."""
    fields = dict(full)
    tokens, t, s = full["tokenizer.ggml.tokens"]
    types, tt, ts = full["tokenizer.ggml.token_type"]
    merges, mt, ms = full["tokenizer.ggml.merges"]
    keep = set(tokens[:BPE_TOKENS])
    kept = [m for m in merges if "".join(m.split(" ")) in keep and all(p in keep for p in m.split(" "))]
    fields["tokenizer.ggml.tokens"] = (tokens[:BPE_TOKENS], t, s)
    fields["tokenizer.ggml.token_type"] = (types[:BPE_TOKENS], tt, ts)
    fields["tokenizer.ggml.merges"] = (kept, mt, ms)
    for key in ["tokenizer.chat_template", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix"]:
        fields.pop(key, None)
    return fields


def byte_level_decoder():
    """GPT-2's byte-level alphabet: character -> byte."""
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + n)] = b
            n += 1
    return table


def small_spm(small):
    """A SentencePiece vocabulary from the small BPE one's tokens (see the module doc)."""
    decode = byte_level_decoder()
    tokens = small["tokenizer.ggml.tokens"][0]
    types = small["tokenizer.ggml.token_type"][0]
    pieces = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)]
    kinds = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(pieces)
    seen = set(pieces)
    rank = 0
    for token, kind in zip(tokens, types):
        if kind == 3:
            # Control tokens of the chat format stay control; one is made user-defined.
            text, kind = token, (4 if token == "<|im_start|>" else 3)
            score = 0.0
        else:
            try:
                text = bytes(decode[c] for c in token).decode("utf-8")
            except (KeyError, UnicodeDecodeError):
                continue
            if "\0" in text:
                # llama.cpp reads token texts as C strings: NUL would cut them short.
                continue
            text = text.replace(" ", "\u2581")
            rank += 1
            score = -float(rank)
        if text in seen:
            continue
        seen.add(text)
        pieces.append(text)
        kinds.append(kind)
        scores.append(score)
    A = gguf.GGUFValueType
    return {
        "tokenizer.ggml.model": ("llama", A.STRING, None),
        "tokenizer.ggml.tokens": (pieces, A.ARRAY, A.STRING),
        "tokenizer.ggml.scores": (scores, A.ARRAY, A.FLOAT32),
        "tokenizer.ggml.token_type": (kinds, A.ARRAY, A.INT32),
        "tokenizer.ggml.bos_token_id": (1, A.UINT32, None),
        "tokenizer.ggml.eos_token_id": (2, A.UINT32, None),
        "tokenizer.ggml.unknown_token_id": (0, A.UINT32, None),
    }


def with_overrides(fields, overrides):
    A = gguf.GGUFValueType
    out = dict(fields)
    for key, value in overrides.items():
        out[key] = (value, A.BOOL if isinstance(value, bool) else A.STRING, None)
    return out


def detokenize(llm, ids, remove_special, unparse_special):
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    size = 4096
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, unparse_special)
    assert 0 <= n < size, n
    return buf.raw[:n].decode("utf-8", errors="replace")


def record(path, with_text):
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    ids = [llm.tokenize(text.encode("utf-8"), add_bos=True, special=True) for text in CORPUS]
    out = {"ids": ids}
    if with_text:
        out["text"] = [detokenize(llm, i, True, False) for i in ids]
        out["text_special"] = [detokenize(llm, i, False, True) for i in ids]
    del llm
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    full = tokenizer_fields(args.model)
    small = small_bpe(full)
    spm = small_spm(small)
    write_vocab(os.path.join(args.out, "bpe-vocab.gguf"), small)
    write_vocab(os.path.join(args.out, "spm-vocab.gguf"), spm)

    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        def case(vocab, fields, overrides, with_text=False):
            path = os.path.join(tmp, "vocab.gguf")
            write_vocab(path, with_overrides(fields, overrides))
            result = record(path, with_text)
            cases.append({"vocab": vocab, "metadata": overrides, **result})
            print(f"{vocab} {overrides}: {sum(map(len, result['ids']))} ids", file=sys.stderr)

        for tag in PRE_TAGS:
            case("bpe-vocab.gguf", small, {"tokenizer.ggml.pre": tag})
        for tag in PRE_TAGS:
            case("default-model", full, {"tokenizer.ggml.pre": tag})
        case("spm-vocab.gguf", spm, {}, with_text=True)
        case("spm-vocab.gguf", spm, {"tokenizer.ggml.add_space_prefix": False}, with_text=True)

    fixture = {
        "generator": "scripts/tokenizer_fixtures.py",
        "llama_cpp_python": llama_cpp.__version__,
        "corpus": CORPUS,
        "cases": cases,
    }
    # One corpus string and one case a line, so that a refresh diffs by case.
    compact = {"ensure_ascii": False, "separators": (",", ":")}
    lines = ["{"]
    for key in ["generator", "llama_cpp_python"]:
        lines.append(f"{json.dumps(key)}:{json.dumps(fixture[key], **compact)},")
    lines.append('"corpus":[')
    lines.append(",\n".join(json.dumps(text, **compact) for text in CORPUS))
    lines.append('],\n"cases":[')
    lines.append(",\n".join(json.dumps(case, **compact) for case in cases))
    lines.append("]}")
    with open(os.path.join(args.out, "ids.json"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
