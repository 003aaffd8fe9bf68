#!/usr/bin/env bash
# Device check on a machine with an NVIDIA GPU and the CUDA toolkit (nvcc), prepared for
# a lent GPU machine: builds ggml's CUDA backend module (libggml-cuda.so) from the same
# pinned ggml sources as the default build, puts it next to the default build's CPU
# modules in one folder, and with SD_GGML_BACKEND_DIR pointing there
#   1. renders the golden SD 1.x subset on CUDA0 (tests/devices.rs, SD_TEST_CUDA=1),
#   2. runs a short benchmark of ours on CUDA0 (one 512x512 f16 generation, 4 steps).
# Output: target/device-check/ (build log, test log, bench log). Exit status: 0 when the
# build and the tests passed.
#
#   scripts/device-check.sh [--no-bench]
# Environment: CUDA_ARCHITECTURES (default: native, i.e. the GPU of this machine),
# SD_GGML_BUILD_DIR (share the default build's ggml, see DESIGN.md).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bench=1
[ "${1:-}" = "--no-bench" ] && bench=0
out=$root/target/device-check
mkdir -p "$out"
die() { echo "device-check: $*" >&2; exit 1; }
command -v nvcc >/dev/null || die "nvcc not found: this check needs the CUDA toolkit"
nvidia-smi -L || die "no NVIDIA GPU visible"

scripts/fetch-sources.sh
echo "device-check: default build (CPU modules)"
cargo build --release -p stable-diffusion 2>&1 | tail -3

# The CUDA module from the same ggml sources, with the default build's CPU modules.
modules=$(scripts/build-backend.sh cuda "$out") || die "CUDA module build failed"
export SD_GGML_BACKEND_DIR=$modules
echo "device-check: devices"
cargo run --release -q -p sd-cli -- --list-devices

echo "device-check: golden SD 1.x subset on CUDA0"
SD_TEST_CUDA=1 cargo test --release --test devices -- --test-threads=1 cuda_ 2>&1 | tee "$out/test.log"
grep -q "test result: ok" "$out/test.log" || die "device tests failed (see $out/test.log)"

if [ "$bench" = 1 ]; then
    echo "device-check: benchmark (ours on CUDA0, 512x512 f16, 4 steps)"
    model=${SD_CLI_MODEL:-$HOME/.cache/sd-rs-fixtures/sd1.safetensors}
    [ -f "$model" ] || scripts/fixtures.sh sd1.safetensors
    /usr/bin/time -v cargo run --release -q -p sd-cli -- -m "$model" --backend cuda0 \
        -p "a lovely cat" -W 512 -H 512 --steps 4 -s 42 -o "$out/bench.png" -v 2>&1 | tee "$out/bench.log" |
        grep -E "completed, taking|generate_image completed|Maximum resident" || true
fi
echo "device-check: passed"
