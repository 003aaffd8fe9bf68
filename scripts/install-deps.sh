#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages the build and the tests need, only those missing:
# cmake, make, g++ (ggml), libclang-dev (bindgen), pkg-config, valgrind (C tests),
# mono-mcs + mono-runtime (C# tests), python3-venv (Python tests), and for the Vulkan
# build and its tests: glslc (shader compiler), libvulkan-dev (loader and headers),
# spirv-headers, mesa-vulkan-drivers (lavapipe, a software Vulkan device), and chromium
# (sd-server's page test renders its page headless). Uses sudo when not root.
set -euo pipefail
want=(cmake make g++ libclang-dev pkg-config valgrind mono-mcs mono-runtime
      glslc libvulkan-dev spirv-headers mesa-vulkan-drivers chromium)
# python3 -m venv needs ensurepip, which Debian ships separately.
if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    want+=(python3-venv)
fi
missing=()
for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "install-deps: all system packages present"
    exit 0
fi
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
