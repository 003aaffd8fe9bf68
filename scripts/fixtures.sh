#!/usr/bin/env bash
# Writes synthetic checkpoints (tests/fixtures/synth_model.py: real architectures,
# deterministic weights) into the fixture cache, outside the repository:
#
#   scripts/fixtures.sh [--venv DIR] ARCH...      e.g. scripts/fixtures.sh sd1
#
# The cache is $SD_FIXTURE_CACHE (default ~/.cache/sd-rs-fixtures); a file that is already
# there is kept. synth_model.py needs numpy: it runs in a virtual environment (default
# target/fixture-venv) where numpy is installed once. Each file is written under a
# temporary name and renamed when complete.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=$root/target/fixture-venv
if [ "${1:-}" = "--venv" ]; then
    venv=${2:?--venv needs a folder}
    shift 2
fi
cache=${SD_FIXTURE_CACHE:-$HOME/.cache/sd-rs-fixtures}

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -c 'import numpy' 2>/dev/null ||
    "$venv/bin/python" -m pip install -q --disable-pip-version-check numpy

mkdir -p "$cache"
for arch in "$@"; do
    case "$arch" in
        sd1-vae) file=vae.safetensors ;;
        sd1-inpaint) file=sd1_inpaint.safetensors ;;
        *) file=$arch.safetensors ;;
    esac
    [ -f "$cache/$file" ] && continue
    echo "fixtures: writing $cache/$file (synthetic $arch checkpoint)"
    tmp=$cache/$file.tmp.$$
    trap 'rm -f "$tmp"' EXIT
    "$venv/bin/python" tests/fixtures/synth_model.py "$arch" "$tmp"
    mv -f "$tmp" "$cache/$file"
    trap - EXIT
done
