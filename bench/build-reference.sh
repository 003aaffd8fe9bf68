#!/usr/bin/env bash
# Builds a stable-diffusion.cpp checkout as a shared library for sd-bench's --ref-lib sides,
# with the ggml the golden data was made with (llama-cpp-sys-2 0.1.161's tree, like our own
# build) instead of its ggml submodule:
#
#   bench/build-reference.sh SRC OUT [--llamafile] [--avx2] [-DNAME=VALUE ...]
#
# SRC   a checkout of leejet/stable-diffusion.cpp (we follow commit 97d29908); its ggml
#       submodule may be missing. Tokenizer tables missing from SRC are taken from
#       diffusion-rs-sys 0.1.20 (byte-identical to 97d29908's).
# OUT   build folder; the library ends up at OUT/build/bin/libstable-diffusion.so (printed).
# --llamafile  ggml's llamafile GEMM kernels on (GGML_LLAMAFILE=ON): the reference's fastest
#              CPU build for float weights.
# --avx2       -march=native off, AVX2/FMA/F16C/BMI2 on: the instruction sets the golden
#              data was made with (the default is the reference's GGML_NATIVE=ON).
# Other arguments go to CMake. OpenMP stays at ggml's default (on), as in the reference's
# own build.
#
# The reference's ggml fork adds two INT8 ConvRot ops that upstream ggml lacks
# (ggml_quantize_i8_convrot, ggml_mul_mat_i8_tensorwise); the build defines them
# (sd-bench-stubs.h, force-included) as one custom CPU op that follows the fork's CPU
# arithmetic step for step (docs/int8_convrot.md of the reference and the fork's kernels: the
# rotation's order of sums, lrint rounding, the fused multiply-add GCC makes of its last two
# statements), for the `int8/` golden cases. The rows are rotated inside the product instead
# of packed first, which changes no value.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 2 ] || { sed -n '2,25p' "$0" >&2; exit 2; }
src=$(cd "$1" && pwd)
out=$(mkdir -p "$2" && cd "$2" && pwd)
shift 2
cmake_args=()
for a in "$@"; do
    case "$a" in
        --llamafile) cmake_args+=(-DGGML_LLAMAFILE=ON) ;;
        --avx2) cmake_args+=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON) ;;
        -D*) cmake_args+=("$a") ;;
        *) echo "build-reference.sh: unknown argument $a" >&2; exit 2 ;;
    esac
done
[ -f "$src/src/stable-diffusion.cpp" ] && [ -f "$src/CMakeLists.txt" ] ||
    { echo "build-reference.sh: $src is not a stable-diffusion.cpp checkout" >&2; exit 1; }

"$root/scripts/fetch-sources.sh" >/dev/null
stage=$out/source
mkdir -p "$stage"
# A copy, so the checkout is never modified; ggml comes from the registry package.
tar -C "$src" --exclude=./.git --exclude=./ggml --exclude=./build -cf - . | tar -C "$stage" -xf -
rm -rf "$stage/ggml"
cp -r "$root/third_party/ggml" "$stage/ggml"
mkdir -p "$stage/src/tokenizers/vocab"
for f in "$root"/third_party/sd-vocab/*; do
    dest="$stage/src/tokenizers/vocab/$(basename "$f")"
    [ -s "$dest" ] || cp "$f" "$dest"
done

stubs=$out/sd-bench-stubs.h
cat >"$stubs" <<EOF
// sd-bench: the ggml fork's INT8 ConvRot ops, absent from upstream ggml, as one custom CPU op
// (written from the fork's documented arithmetic, see build-reference.sh).
#pragma once
#ifdef __cplusplus
#include "$stage/ggml/include/ggml.h"
#include <cmath>
#include <cstdint>
#include <vector>
static void sd_bench_i8_rotate(float* v, int n) {
    const float norm = 1.0f / std::sqrt((float)n);
    for (int i = 0; i < n; i++) v[i] *= norm;
    for (int stride = 1; stride < n; stride *= 4) {
        for (int base = 0; base < n; base += 4 * stride) {
            for (int j = base; j < base + stride; j++) {
                const float a = v[j], b = v[j + stride], c = v[j + 2 * stride], d = v[j + 3 * stride];
                v[j]              = a + b + c - d;
                v[j + stride]     = a + b - c + d;
                v[j + 2 * stride] = a - b + c + d;
                v[j + 3 * stride] = -a + b + c + d;
            }
        }
    }
}
static float sd_bench_i8_quantize(const float* x, int64_t k, int group, float* work, int8_t* q) {
    for (int64_t i = 0; i < k; i++) work[i] = x[i];
    if (group > 0) for (int64_t i = 0; i < k; i += group) sd_bench_i8_rotate(work + i, group);
    float amax = 0.0f;
    for (int64_t i = 0; i < k; i++) { const float a = std::fabs(work[i]); amax = amax > a ? amax : a; }
    const float scale = amax / 127.0f;
    if (scale == 0.0f) { for (int64_t i = 0; i < k; i++) q[i] = 0; return scale; }
    const float inv = 1.0f / scale;
    for (int64_t i = 0; i < k; i++) {
        long r = std::lrint(work[i] * inv);
        q[i] = (int8_t)(r < -127 ? -127 : r > 127 ? 127 : r);
    }
    return scale;
}
static void sd_bench_i8_linear(ggml_tensor* dst, int ith, int nth, void* userdata) {
    const ggml_tensor* x = dst->src[0]; const ggml_tensor* w = dst->src[1]; const ggml_tensor* ws = dst->src[2];
    const ggml_tensor* b = dst->src[3];
    const int group = (int)(intptr_t)userdata;
    const int64_t k = x->ne[0], n = dst->ne[0], rows = dst->ne[1] * dst->ne[2] * dst->ne[3];
    std::vector<float> work(k); std::vector<int8_t> q(k);
    for (int64_t r = ith; r < rows; r += nth) {
        const float s = sd_bench_i8_quantize((const float*)x->data + r * k, k, group, work.data(), q.data());
        for (int64_t o = 0; o < n; o++) {
            const int8_t* wr = (const int8_t*)w->data + o * k;
            int32_t sum = 0;
            for (int64_t i = 0; i < k; i++) sum += (int32_t)wr[i] * (int32_t)q[i];
            const float v = (float)sum * s;
            const float sw = ((const float*)ws->data)[o];
            ((float*)dst->data)[r * n + o] = b ? std::fma(v, sw, ((const float*)b->data)[o]) : v * sw;
        }
    }
}
static inline ggml_tensor* ggml_mul_mat_i8_tensorwise(ggml_context* ctx, ggml_tensor* w, ggml_tensor* x, ggml_tensor* ws, ggml_tensor* b, int group, ...) {
    GGML_ASSERT(w->type == GGML_TYPE_I8 && x->type == GGML_TYPE_F32 && ggml_is_contiguous(x) && ws != nullptr);
    ggml_tensor* args[4] = {x, w, ws, b};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], x->ne[1], x->ne[2], x->ne[3], args, b ? 4 : 3,
                          sd_bench_i8_linear, -1, (void*)(intptr_t)group);
}
// The fork packs rotated I8 rows and their scales here; the op above rotates and quantizes
// each row itself (the same values), so the activations pass through.
static inline ggml_tensor* ggml_quantize_i8_convrot(ggml_context*, ggml_tensor* x, int) {
    return x;
}
#endif
EOF
stub_flags=""
if ! grep -q ggml_quantize_i8_convrot "$stage/ggml/include/ggml.h" && grep -rq ggml_quantize_i8_convrot "$stage/src"; then
    stub_flags="-include $stubs"
fi

cmake -S "$stage" -B "$out/build" -DCMAKE_BUILD_TYPE=Release \
    -DSD_BUILD_SHARED_LIBS=ON -DSD_BUILD_EXAMPLES=OFF -DSD_WEBP=OFF -DSD_WEBM=OFF \
    "-DCMAKE_CXX_FLAGS=$stub_flags" "${cmake_args[@]}" >"$out/cmake.log" 2>&1
cmake --build "$out/build" -j "$(nproc)" --target stable-diffusion >"$out/build.log" 2>&1 ||
    { tail -30 "$out/build.log" >&2; exit 1; }
lib=$(find "$out/build" -name 'libstable-diffusion.so' -print -quit)
[ -n "$lib" ] || { echo "build-reference.sh: no libstable-diffusion.so under $out/build" >&2; exit 1; }
echo "$lib"
