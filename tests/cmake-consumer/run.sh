#!/usr/bin/env bash
# Builds and runs a consumer of the installed package three ways: CMake with
# find_package(stable-diffusion) (shared, then STABLE_DIFFUSION_USE_STATIC=ON), and plain
# `cc $(pkg-config --cflags --libs stable-diffusion)`.
#   tests/cmake-consumer/run.sh PREFIX
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
prefix=$(cd "${1:?usage: run.sh PREFIX}" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for mode in shared static; do
    echo "== CMake consumer ($mode)"
    static=OFF
    [ $mode = static ] && static=ON
    cmake -S "$here" -B "$work/$mode" -DCMAKE_PREFIX_PATH="$prefix" -DSTABLE_DIFFUSION_USE_STATIC=$static \
        -DCMAKE_BUILD_TYPE=Release >"$work/$mode.log" 2>&1 || { cat "$work/$mode.log"; exit 1; }
    grep 'stable-diffusion .* in ' "$work/$mode.log" || true
    cmake --build "$work/$mode" >>"$work/$mode.log" 2>&1 || { cat "$work/$mode.log"; exit 1; }
    if [ $mode = static ] && readelf -d "$work/$mode/consumer" | grep -q 'NEEDED.*libstable-diffusion'; then
        echo "cmake consumer: the static build links the shared library" >&2
        exit 1
    fi
    timeout 300 "$work/$mode/consumer"
done

echo "== pkg-config consumer"
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
libdir=$(pkg-config --variable=libdir stable-diffusion)
cc -o "$work/pc-consumer" "$here/main.c" $(pkg-config --cflags --libs stable-diffusion) -Wl,-rpath,"$libdir"
timeout 300 "$work/pc-consumer"
echo "consumers: cmake (shared, static) and pkg-config passed"
