#!/usr/bin/env bash
# One-command set-up on a fresh Debian/Ubuntu machine with Rust, gcc, Python 3 and git:
# system packages, third-party sources, a release build installed into ./prefix, then the
# main program: sd-cli generates output.png from the synthetic SD1 checkpoint (written
# once into ~/.cache/sd-rs-fixtures by scripts/fixtures.sh; no download), with a progress bar.
#   scripts/setup.sh [install.sh options, e.g. --features native]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/fetch-sources.sh
scripts/install.sh --prefix ./prefix "$@"
scripts/fixtures.sh sd1
./prefix/bin/sd-cli -p "a lovely cat" -W 256 -H 256 --steps 10 -o output.png
