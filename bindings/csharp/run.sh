#!/usr/bin/env bash
# Builds the C# bindings (StableDiffusion.dll) and their test program with mono's mcs and
# runs the tests under mono against the library installed in PREFIX; then packs them
# (pack.sh) and runs a consumer application built against the package alone.
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
timeout 600 mono --debug "$out/tests.exe" "$lib"

# The package as a consumer uses it: pack.sh's .nupkg unpacked, an application compiled
# against its StableDiffusion.dll alone and run beside the package's files (the layout of a
# published application), from another folder and with no library path set.
"$here/pack.sh" "$prefix" "$out/pack" >/dev/null
app=$out/consumer
rm -rf "$app"
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$out"/pack/*.nupkg "$app/nupkg"
cp "$app/nupkg/lib/net45/StableDiffusion.dll" "$app"/nupkg/runtimes/linux-x64/native/* "$app/"
mcs -nologo -warnaserror -target:exe -r:"$app/StableDiffusion.dll" -out:"$app/Consumer.exe" "$here/tests/consumer/Consumer.cs"
(cd / && env -u LD_LIBRARY_PATH timeout 120 mono "$app/Consumer.exe")
