#!/usr/bin/env bash
# Builds one of ggml's device backends as a loadable module (libggml-<name>.so) from the
# same pinned ggml sources and settings as the default build, and puts it with the default
# build's CPU modules into one folder, for SD_GGML_BACKEND_DIR: the default build then runs
# on that device without being rebuilt (ggml's backends are dynamically loaded modules).
#
#   scripts/build-backend.sh vulkan|cuda OUT [-DNAME=VALUE ...]
#
# Prints the folder (OUT/backends). Needs the default build first (cargo build --release);
# its ggml libraries are found under $CARGO_TARGET_DIR (default target/). Vulkan needs
# glslc and the Vulkan headers (scripts/install-deps.sh installs them); CUDA needs nvcc.
# The module links against its own libggml-base.so, the same source and ABI as ours; in our
# process ours is the one loaded.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
[ $# -ge 2 ] || { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
name=$1
out=$(mkdir -p "$2" && cd "$2" && pwd)
shift 2
case "$name" in
    vulkan) flags=(-DGGML_VULKAN=ON) ;;
    cuda) flags=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-native}" -DCMAKE_CUDA_FLAGS=-DGGML_MAX_NAME=160) ;;
    *) echo "build-backend.sh: unknown backend '$name' (vulkan, cuda)" >&2; exit 2 ;;
esac
die() { echo "build-backend.sh: $*" >&2; exit 1; }

target_dir=${CARGO_TARGET_DIR:-$root/target}
base=$(ls -t "$target_dir"/release/build/ggml-sys-*/out/lib/libggml-base.so 2>/dev/null | head -1)
[ -n "$base" ] || die "no default build under $target_dir/release (run cargo build --release first)"
scripts/fetch-sources.sh >/dev/null

# Configured like ggml/build.rs: shared libraries, loadable backends, GGML_MAX_NAME=160.
build=$out/build-$name
cmake -S ggml/cmake -B "$build" -G "Unix Makefiles" \
    -DGGML_SOURCE_DIR="$root/third_party/ggml" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_NATIVE=OFF \
    -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DGGML_CCACHE=OFF -DGGML_LLAMAFILE=OFF \
    -DCMAKE_C_FLAGS=-DGGML_MAX_NAME=160 -DCMAKE_CXX_FLAGS=-DGGML_MAX_NAME=160 \
    "${flags[@]}" "$@" >"$out/cmake-$name.log" 2>&1 || die "cmake failed (see $out/cmake-$name.log)"
cmake --build "$build" --target "ggml-$name" -j "$(nproc)" >"$out/build-$name.log" 2>&1 ||
    die "the $name module did not build (see $out/build-$name.log)"
module=$(find "$build" -name "libggml-$name.so" | head -1)
[ -n "$module" ] || die "no libggml-$name.so under $build"

modules=$out/backends
mkdir -p "$modules"
rm -f "$modules"/libggml-*.so
cp -a "$(dirname "$base")"/libggml-cpu-*.so "$modules"/
cp "$module" "$modules"/
echo "$modules"
