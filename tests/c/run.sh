#!/usr/bin/env bash
# Builds tests/c/api_test.c against the header installed in PREFIX, once linked with the
# shared library and once with the static one, and runs both under valgrind: any memory
# error or leak fails the run.
#   tests/c/run.sh PREFIX        (SD_C_TEST_NO_VALGRIND=1 runs them without valgrind)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
prefix=$(cd "${1:?usage: run.sh PREFIX}" && pwd)
for f in include/stable-diffusion.h lib/libstable-diffusion.so lib/libstable-diffusion.a lib/pkgconfig/stable-diffusion.pc; do
    [ -e "$prefix/$f" ] || { echo "c tests: missing $prefix/$f (run scripts/install.sh first)" >&2; exit 1; }
done
out=$here/build
mkdir -p "$out"
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
cflags=(-std=c11 -g -O1 -Wall -Wextra -Werror -I"$here" $(pkg-config --cflags stable-diffusion))

echo "== building against the shared library"
gcc "${cflags[@]}" "$here/api_test.c" -o "$out/api_test_shared" \
    $(pkg-config --libs stable-diffusion) -Wl,-rpath,"$prefix/lib"

echo "== building against the static library"
# The archive by path (the .so next to it would win over -l); the rest from Libs.private.
private=$(pkg-config --static --libs-only-l stable-diffusion | sed 's/-lstable-diffusion//')
gcc "${cflags[@]}" "$here/api_test.c" -o "$out/api_test_static" \
    "$prefix/lib/libstable-diffusion.a" -L"$prefix/lib" $private -Wl,-rpath,"$prefix/lib"
if readelf -d "$out/api_test_static" | grep -q 'NEEDED.*libstable-diffusion'; then
    echo "c tests: api_test_static needs libstable-diffusion.so: not a static link" >&2
    exit 1
fi

status=0
run() {
    echo "== $1"
    if [ "${SD_C_TEST_NO_VALGRIND:-0}" = 1 ]; then
        timeout 900 "$out/$1"
    else
        # Errors and definite/indirect/possible leaks fail the run; memory still reachable at
        # exit (ggml's backend registry, loaded modules, Rust's std runtime) is not a leak.
        timeout 1800 valgrind --quiet --leak-check=full --show-leak-kinds=definite,indirect,possible \
            --errors-for-leak-kinds=definite,indirect,possible --error-exitcode=1 \
            --suppressions="$here/valgrind.supp" "$out/$1"
    fi || { echo "c tests: $1 FAILED"; status=1; }
}
run api_test_shared
run api_test_static
[ $status = 0 ] && echo "c tests: shared and static builds passed"
exit $status
