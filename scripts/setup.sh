#!/usr/bin/env bash
# One-command set-up on a fresh Debian/Ubuntu machine with Rust, gcc, Python 3 and git:
# system packages, third-party sources, a release build installed into ./prefix, then the
# main program, sd-cli (library version, commit, system info and devices).
#   scripts/setup.sh [install.sh options, e.g. --features native]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/fetch-sources.sh
scripts/install.sh --prefix ./prefix "$@"
./prefix/bin/sd-cli
