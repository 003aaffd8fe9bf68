#!/usr/bin/env bash
# Brings the third-party sources the build needs, like a submodule init: cargo fetches the
# pinned registry packages (checksums from Cargo.lock) and we unpack the parts we use into
# third_party/ (git-ignored):
#   third_party/ggml                       ggml tree of llama-cpp-sys-2 0.1.161
#   third_party/clip/bpe_simple_vocab_16e6.txt   CLIP BPE vocabulary of instant-clip-tokenizer 0.1.0
#   third_party/sd-vocab/*.hpp             tokenizer tables of the reference (T5, UMT5, Qwen2, Mistral,
#                                          Gemma, GPT-OSS) as C byte arrays, from diffusion-rs-sys 0.1.20
#                                          (byte-identical to the reference's); build.rs decodes them
# Set GGML_SOURCE_DIR at build time to use a ggml tree of your own instead.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cargo fetch --locked >/dev/null
cache=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/ | head -n1)

unpack() { # crate-archive member-path destination strip-depth
    local archive="$cache/$1.crate" member="$1/$2" dest=$3 strip=$4
    [ -f "$archive" ] || { echo "missing $archive (cargo fetch failed?)" >&2; exit 1; }
    local tmp; tmp=$(mktemp -d "$root/third_party/.unpack.XXXXXX")
    tar -xzf "$archive" -C "$tmp" --strip-components="$strip" "$member"
    rm -rf "$dest"; mkdir -p "$(dirname "$dest")"; mv "$tmp" "$dest"
}

mkdir -p third_party
[ -f third_party/ggml/include/ggml.h ] || unpack llama-cpp-sys-2-0.1.161 llama.cpp/ggml third_party/ggml 3
if [ ! -f third_party/clip/bpe_simple_vocab_16e6.txt ]; then
    unpack instant-clip-tokenizer-0.1.0 bpe_simple_vocab_16e6.txt third_party/clip.tmp 1
    mkdir -p third_party/clip && mv third_party/clip.tmp/bpe_simple_vocab_16e6.txt third_party/clip/ && rm -rf third_party/clip.tmp
fi
if [ ! -f third_party/sd-vocab/t5.hpp ]; then
    unpack diffusion-rs-sys-0.1.20 stable-diffusion.cpp/src/tokenizers/vocab third_party/sd-vocab 5
    rm -f third_party/sd-vocab/*.cpp third_party/sd-vocab/*.h # only the tables are data
fi
echo "third_party/ ready"
