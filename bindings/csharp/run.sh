#!/usr/bin/env bash
# Builds the C# bindings (StableDiffusion.dll) and their test program with mono's mcs and
# runs the tests under mono against the library installed in PREFIX.
#   bindings/csharp/run.sh PREFIX
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
prefix=$(cd "${1:?usage: run.sh PREFIX}" && pwd)
lib=$prefix/lib/libstable-diffusion.so
[ -e "$lib" ] || { echo "csharp: no $lib (run scripts/install.sh first)" >&2; exit 1; }
for tool in mcs mono; do
    command -v $tool >/dev/null || { echo "csharp: $tool not found (apt-get install mono-mcs mono-runtime)" >&2; exit 1; }
done
out=$here/bin
mkdir -p "$out"
mcs -nologo -warnaserror -target:library -out:"$out/StableDiffusion.dll" \
    "$here/NativeMethods.g.cs" "$here/StableDiffusion.cs"
mcs -nologo -warnaserror -target:exe -r:"$out/StableDiffusion.dll" -out:"$out/tests.exe" "$here"/tests/*.cs
# mono resolves [DllImport("stable-diffusion")] to libstable-diffusion.so on the library path.
export LD_LIBRARY_PATH=$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
exec timeout 600 mono --debug "$out/tests.exe" "$lib"
