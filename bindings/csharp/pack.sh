#!/usr/bin/env bash
# Packs the C# bindings as a NuGet package, built with mono's mcs (no .NET SDK needed):
#   bindings/csharp/pack.sh PREFIX OUTDIR
# writes OUTDIR/StableDiffusion.Rs.VERSION.nupkg and the same files unpacked in
# OUTDIR/package/:
#   lib/net45/StableDiffusion.dll (+ .xml documentation)  the bindings (NativeMethods.g.cs,
#                                                           StableDiffusion.cs)
#   runtimes/linux-x64/native/                               PREFIX/lib's libstable-diffusion.so,
#        libggml.so.0, libggml-base.so.0 and the ggml backend modules (libggml-cpu-*.so ...):
#        the library finds the others beside itself
#   StableDiffusion.Rs.nuspec, [Content_Types].xml
# VERSION is the workspace's (Cargo.toml).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
prefix=$(cd "${1:?usage: pack.sh PREFIX OUTDIR}" && pwd)
out=${2:?usage: pack.sh PREFIX OUTDIR}
command -v mcs >/dev/null || { echo "pack.sh: mcs not found (apt-get install mono-mcs)" >&2; exit 1; }
[ -e "$prefix/lib/libstable-diffusion.so" ] || { echo "pack.sh: no $prefix/lib/libstable-diffusion.so (run scripts/install.sh first)" >&2; exit 1; }
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$here/../../Cargo.toml" | head -1)
id=StableDiffusion.Rs
pkg=$out/package
rm -rf "$pkg"
mkdir -p "$pkg/lib/net45" "$pkg/runtimes/linux-x64/native"
mcs -nologo -warnaserror -nowarn:1591 -target:library -doc:"$pkg/lib/net45/StableDiffusion.xml" \
    -out:"$pkg/lib/net45/StableDiffusion.dll" "$here/NativeMethods.g.cs" "$here/StableDiffusion.cs"
# The native files under the names the loaders ask for: P/Invoke probes
# libstable-diffusion.so, the library's NEEDED entries are the .so.0 names.
native=$pkg/runtimes/linux-x64/native
cp -L "$prefix/lib/libstable-diffusion.so" "$native/"
for f in "$prefix"/lib/libggml*.so*; do
    name=$(basename "$f")
    case "$name" in
        *.so.[0-9]*.[0-9]*) ;;                    # the fully versioned file: its .so.0 link is taken
        libggml.so | libggml-base.so) ;;          # development links
        *) cp -L "$f" "$native/$name" ;;
    esac
done
cat > "$pkg/$id.nuspec" <<NUSPEC
<?xml version="1.0" encoding="utf-8"?>
<package xmlns="http://schemas.microsoft.com/packaging/2013/05/nuspec.xsd">
  <metadata>
    <id>$id</id>
    <version>$version</version>
    <authors>stable-diffusion-rs</authors>
    <license type="expression">MIT</license>
    <description>P/Invoke bindings of libstable-diffusion (the stable-diffusion.cpp C API, implemented in Rust), with the native library for linux-x64.</description>
    <tags>stable-diffusion image-generation native</tags>
  </metadata>
</package>
NUSPEC
python3 - "$pkg" "$out/$id.$version.nupkg" <<'PY'
import os, sys, zipfile
pkg, target = sys.argv[1], sys.argv[2]
files = sorted(os.path.relpath(os.path.join(d, f), pkg) for d, _, fs in os.walk(pkg) for f in fs)
exts = sorted({os.path.splitext(f)[1].lstrip(".") for f in files} - {""} | {"rels", "psmdcp"})
types = "".join(f'<Default Extension="{e}" ContentType="application/octet" />' for e in exts)
with open(os.path.join(pkg, "[Content_Types].xml"), "w") as t:
    t.write('<?xml version="1.0" encoding="utf-8"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
            + types + "</Types>")
with zipfile.ZipFile(target + ".tmp", "w", zipfile.ZIP_DEFLATED) as z:
    for f in ["[Content_Types].xml"] + files:
        z.write(os.path.join(pkg, f), f)
os.replace(target + ".tmp", target)
PY
echo "pack.sh: $out/$id.$version.nupkg"
