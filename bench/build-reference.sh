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
# The reference's ggml fork adds two INT8 ConvRot ops that upstream ggml lacks; the build
# declares them as stubs that abort (sd-bench-stubs.h, force-included), as the golden data's
# build did. No benchmark or golden case uses them.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 2 ] || { sed -n '2,21p' "$0" >&2; exit 2; }
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
// sd-bench: the ggml fork's INT8 ConvRot ops, absent from upstream ggml; never called here.
#pragma once
#ifdef __cplusplus
#include "$stage/ggml/include/ggml.h"
static inline ggml_tensor* ggml_mul_mat_i8_tensorwise(ggml_context*, ggml_tensor*, ggml_tensor*, ggml_tensor*, ggml_tensor*, int, ...) {
    GGML_ABORT("INT8 ConvRot is not in this ggml");
}
static inline ggml_tensor* ggml_quantize_i8_convrot(ggml_context*, ggml_tensor*, int) {
    GGML_ABORT("INT8 ConvRot is not in this ggml");
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
