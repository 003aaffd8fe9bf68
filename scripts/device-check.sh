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

# The CUDA module, configured like ggml-sys's build (ggml/build.rs): shared libraries with
# loadable backends, GGML_MAX_NAME=160. It links against its own libggml-base.so, which
# is the same source and ABI as ours; in our process ours is the one loaded.
cuda_build=$out/ggml-cuda
cmake -S ggml/cmake -B "$cuda_build" -G "Unix Makefiles" \
    -DGGML_SOURCE_DIR="$root/third_party/ggml" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_NATIVE=OFF \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES:-native}" \
    -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DGGML_CCACHE=OFF \
    -DCMAKE_C_FLAGS=-DGGML_MAX_NAME=160 -DCMAKE_CXX_FLAGS=-DGGML_MAX_NAME=160 \
    -DCMAKE_CUDA_FLAGS=-DGGML_MAX_NAME=160 >"$out/cmake.log" 2>&1 || die "cmake failed (see $out/cmake.log)"
cmake --build "$cuda_build" --target ggml-cuda -j "$(nproc)" >"$out/build.log" 2>&1 || die "CUDA module build failed (see $out/build.log)"
cuda_so=$(find "$cuda_build" -name 'libggml-cuda.so' | head -1)
[ -n "$cuda_so" ] || die "no libggml-cuda.so in $cuda_build"

# One folder with the CPU modules of the default build and the CUDA module.
ggml_lib=$(dirname "$(ls -t target/release/build/ggml-sys-*/out/lib/libggml-base.so | head -1)")
modules=$out/backends
rm -rf "$modules" && mkdir -p "$modules"
cp -a "$ggml_lib"/libggml-cpu-*.so "$modules"/
cp "$cuda_so" "$modules"/
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
