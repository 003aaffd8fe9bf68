#!/usr/bin/env bash
# Writes synthetic checkpoints (tests/fixtures/synth_model.py and its family files: real
# architectures, deterministic weights) into the fixture cache, outside the repository:
#
#   scripts/fixtures.sh [--venv DIR] NAME...     e.g. scripts/fixtures.sh sd1 loras/lora_sd1.safetensors
#   scripts/fixtures.sh [--venv DIR] --python    makes the numpy environment, prints its python
#
# NAME is a file of tests/fixtures/recipes.tsv (e.g. sdxl.safetensors) or its synth_model.py
# arch (e.g. sdxl). The cache is $SD_FIXTURE_CACHE (default ~/.cache/sd-rs-fixtures); a file
# already there is kept. synth_model.py needs numpy: it runs in a virtual environment
# ($SD_FIXTURE_VENV, default target/fixture-venv) where numpy is installed once. Each file is
# made by one process at a time (a lock file beside it), under a unique temporary name that
# is renamed when complete; on failure the script's error is printed and the exit status is 1.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${SD_FIXTURE_VENV:-$root/target/fixture-venv}
if [ "${1:-}" = "--venv" ]; then
    venv=${2:?--venv needs a folder}
    shift 2
fi
cache=${SD_FIXTURE_CACHE:-$HOME/.cache/sd-rs-fixtures}
recipes=$root/tests/fixtures/recipes.tsv

python_ready() {
    if [ ! -x "$venv/bin/python" ]; then
        mkdir -p "$(dirname "$venv")"
        (flock 9; [ -x "$venv/bin/python" ] || python3 -m venv "$venv") 9>"$venv.lock"
    fi
    "$venv/bin/python" -c 'import numpy' 2>/dev/null ||
        (flock 9; "$venv/bin/python" -c 'import numpy' 2>/dev/null ||
            "$venv/bin/python" -m pip install -q --disable-pip-version-check numpy) 9>"$venv.lock"
}

if [ "${1:-}" = "--python" ]; then
    python_ready >&2
    echo "$venv/bin/python"
    exit 0
fi

for name in "$@"; do
    line=$(awk -F'\t' -v n="$name" '!/^#/ && ($1 == n || $2 == n) { print; exit }' "$recipes")
    [ -n "$line" ] || { echo "fixtures: no recipe for '$name' in tests/fixtures/recipes.tsv" >&2; exit 1; }
    file=${line%%$'\t'*}
    args=${line#*$'\t'}
    dest=$cache/$file
    [ -f "$dest" ] && continue
    python_ready
    mkdir -p "$(dirname "$dest")"
    (
        flock 9
        [ -f "$dest" ] && exit 0
        echo "fixtures: writing $dest (synth_model.py $args)" >&2
        tmp=$(dirname "$dest")/.$(basename "$dest").tmp.$$.$RANDOM
        trap 'rm -f "$tmp"' EXIT
        # shellcheck disable=SC2086
        set -- $args
        arch=$1
        shift
        "$venv/bin/python" tests/fixtures/synth_model.py "$arch" "$tmp" "$@"
        mv -f "$tmp" "$dest"
        trap - EXIT
    ) 9>"$(dirname "$dest")/.$(basename "$dest").lock"
done
