#!/usr/bin/env bash
# Runs the GPU tests and benchmarks of a bundle made by `cargo xtask gpu-test --bundle`, on a
# machine with an NVIDIA GPU, its driver and Python's `nvidia` packages (NCCL, cuBLAS, NVRTC),
# and no Rust: the test binaries were built elsewhere.
#
# Usage: run.sh [OUT]   (logs go to OUT, default ./out beside this script)
#
# The bundle: bin.tar.gz (the tpctl binary, the GPU test binaries, the NCCL benchmark), model/
# (the default model in parts, joined here once) and this script. Exits non-zero when a test
# failed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/out}"
mkdir -p "$out" "$here/bin"
log="$out/gpu-test.log"
: >"$log"
say() { echo "$@" | tee -a "$log"; }

[ -x "$here/bin/tpctl" ] || tar -xzf "$here/bin.tar.gz" -C "$here/bin"

# The default model, where the tests look for it.
export TPCTL_CACHE="$here/cache"
mkdir -p "$TPCTL_CACHE"
name="$(cat "$here/model/NAME")"
if [ ! -f "$TPCTL_CACHE/$name" ]; then
    if [ "$(ls "$here"/model/part-* 2>/dev/null | wc -l)" = "$(cat "$here/model/PARTS")" ]; then
        cat "$here"/model/part-* >"$TPCTL_CACHE/$name"
    else
        say "model parts missing: have $(ls "$here"/model/part-* 2>/dev/null | wc -l) of $(cat "$here/model/PARTS")"
        exit 2
    fi
fi
say "model: $(wc -c <"$TPCTL_CACHE/$name") bytes ($name)"

# cudarc loads NCCL, cuBLAS and NVRTC by unversioned names; the wheels ship versioned ones.
libs="$here/libs"
mkdir -p "$libs"
path="$libs"
nvidia="$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)"
for lib in nccl cublas nvrtc; do
    f="$(find "$nvidia" -maxdepth 4 -name "lib$lib.so.[0-9]*" 2>/dev/null | sort | head -n 1)"
    if [ -n "$f" ]; then
        ln -sf "$f" "$libs/lib$lib.so"
        path="$path:$(dirname "$f")"
        say "$lib: $f"
    else
        say "$lib: not found under Python's nvidia packages"
    fi
done
export LD_LIBRARY_PATH="$path:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$log"

# The GPU tests: every test whose name mentions cuda, gpu, nvml or nccl must pass on the GPU.
export TPCTL_REQUIRE_GPU=1 TPCTL_BIN="$here/bin/tpctl" TPCTL_TEST_TMPDIR="$here/tmp"
mkdir -p "$TPCTL_TEST_TMPDIR"
status=0
for t in "$here"/bin/test-*; do
    say "== $(basename "$t")"
    if ! "$t" cuda gpu nvml nccl 2>&1 | tee -a "$log"; then
        status=1
        say "FAILED: $(basename "$t")"
    fi
done

# Benchmarks: the default model's tokens/s on the GPU (f32 and bf16 weights) next to the CPU,
# one rank, 64 greedy tokens; then NCCL all-reduce bus bandwidth (needs two GPUs).
say "== tpctl run, SmolLM2-135M Q4_1, one rank, 64 tokens"
for cfg in "cpu f32" "cuda f32" "cuda bf16"; do
    set -- $cfg
    line="$("$here/bin/tpctl" run --model "$TPCTL_CACHE/$name" --device "$1" --dtype "$2" \
        --max-tokens 64 --temperature 0 --prompt "The capital of France is" 2>&1 \
        | grep '^-- ' || echo "no summary (failed)")"
    say "$1 $2: $line"
done
say "== nccl all_reduce"
"$here/bin/nccl-bench" 2>&1 | tee -a "$log" || status=1
say "exit status $status"
exit $status
