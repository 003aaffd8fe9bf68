#!/usr/bin/env bash
# Writes synthetic checkpoints (tests/fixtures/synth_model.py and its family files: real
# architectures, deterministic weights) into the fixture cache, outside the repository:
#
#   scripts/fixtures.sh [--venv DIR] NAME...     e.g. scripts/fixtures.sh sd1 loras/lora_sd1.safetensors
#   scripts/fixtures.sh [--venv DIR] --python    makes the numpy environment, prints its python
#   scripts/fixtures.sh --make-room              frees disk space now (see below)
#
# NAME is a file of tests/fixtures/recipes.tsv (e.g. sdxl.safetensors) or its synth_model.py
# arch (e.g. sdxl). The cache is $SD_FIXTURE_CACHE (default ~/.cache/sd-rs-fixtures); a file
# already there is kept. synth_model.py needs numpy: it runs in a virtual environment
# ($SD_FIXTURE_VENV, default target/fixture-venv) where numpy is installed once. Each file is
# made by one process at a time (a lock file beside it), under a unique temporary name that
# is renamed when complete; on failure the script's error is printed and the exit status is 1.
#
# The cache is bounded by the disk, not by a size: before a file is written, cached
# fixtures are removed, least recently used first (the tests stamp a file's access time
# when they use it), until $SD_FIXTURE_MIN_FREE_MB (default 10240) are free on the cache's
# file system. A file used in the last two minutes is kept (a test may be about to open
# it), and so is every file the same invocation was asked for; only files that are made
# again when missing are removed (recipes.tsv, and the q8_0 conversions and split
# checkpoints the tests write). A write that fails on a full disk is retried once after
# everything removable is gone. On a large disk nothing is removed. With $SD_FIXTURE_LOG set,
# each file written appends "NAME SECONDS s" to that file (where a cold test run's time goes).
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

min_free_mb=${SD_FIXTURE_MIN_FREE_MB:-10240}

free_mb() { df -Pm "$cache" | awk 'NR == 2 { print $4 }'; }

# The files this invocation was asked for: making one never removes another.
declare -A keep=()

# Removes least recently used fixtures until $1 MB are free (or nothing removable is left).
make_room() {
    local want=$1 now at size path rel
    mkdir -p "$cache"
    [ "$(free_mb)" -ge "$want" ] && return 0
    now=$(date +%s)
    while read -r at size path; do
        [ "$(free_mb)" -ge "$want" ] && break
        [ $((now - ${at%.*})) -lt 120 ] && continue
        rel=${path#"$cache"/}
        [ -n "${keep[$rel]:-}" ] && continue
        case "$rel" in
            *_ref_q8_0.gguf) continue ;;
            *_q8_0.gguf | *_split_*.safetensors) ;;
            *) awk -F'\t' -v n="$rel" '!/^#/ && $1 == n { found = 1 } END { exit !found }' "$recipes" || continue ;;
        esac
        echo "fixtures: removing $rel ($((size >> 20)) MB, least recently used) to keep $want MB free" >&2
        rm -f "$path"
    done < <(find "$cache" -type f ! -name '.*' -printf '%A@ %s %p\n' | sort -n)
}

if [ "${1:-}" = "--make-room" ]; then
    make_room "$min_free_mb"
    exit 0
fi

if [ "${1:-}" = "--python" ]; then
    python_ready >&2
    echo "$venv/bin/python"
    exit 0
fi

recipe() { awk -F'\t' -v n="$1" '!/^#/ && ($1 == n || $2 == n) { print; exit }' "$recipes"; }

for name in "$@"; do
    line=$(recipe "$name")
    [ -n "$line" ] && keep[${line%%$'\t'*}]=1
done

for name in "$@"; do
    line=$(recipe "$name")
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
        make_room "$min_free_mb"
        echo "fixtures: writing $dest (synth_model.py $args)" >&2
        began=$SECONDS
        tmp=$(dirname "$dest")/.$(basename "$dest").tmp.$$.$RANDOM
        trap 'rm -f "$tmp"' EXIT
        # shellcheck disable=SC2086
        set -- $args
        arch=$1
        shift
        if ! "$venv/bin/python" tests/fixtures/synth_model.py "$arch" "$tmp" "$@"; then
            full=$(( $(free_mb) < 1024 ))
            rm -f "$tmp"
            [ "$full" = 1 ] || exit 1
            echo "fixtures: the disk filled up; retrying $file with every removable fixture gone" >&2
            make_room $((1 << 40))
            "$venv/bin/python" tests/fixtures/synth_model.py "$arch" "$tmp" "$@"
        fi
        mv -f "$tmp" "$dest"
        trap - EXIT
        [ -z "${SD_FIXTURE_LOG:-}" ] || echo "$file $((SECONDS - began)) s" >>"$SD_FIXTURE_LOG"
    ) 9>"$(dirname "$dest")/.$(basename "$dest").lock"
done
