#!/usr/bin/env bash
# Brings the third-party files the build needs, like a submodule init: cargo fetches the
# pinned registry packages (checksums from Cargo.lock) and we unpack the paths listed in
# scripts/third-party.tsv into third_party/ (git-ignored), e.g.
#   third_party/ggml                              ggml tree of llama-cpp-sys-2 0.1.161
#   third_party/clip/bpe_simple_vocab_16e6.txt    CLIP BPE vocabulary of instant-clip-tokenizer 0.1.0
#   third_party/sd-vocab/*.hpp                    the reference's other tokenizer tables (T5, UMT5,
#                                                 Qwen2, Mistral, Gemma, GPT-OSS) of diffusion-rs-sys 0.1.20
# `cargo build` does the same by itself when a file is missing (scripts/third_party.rs);
# this script is for doing it ahead, e.g. before going offline.
# Set GGML_SOURCE_DIR at build time to use a ggml tree of your own instead.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cargo fetch --locked >/dev/null
cache_dirs=("${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/)

unpack() { # package version member destination
    local name="$1-$2" archive="" dir
    for dir in "${cache_dirs[@]}"; do
        [ -f "$dir/$name.crate" ] && archive="$dir/$name.crate" && break
    done
    [ -n "$archive" ] || { echo "missing $name.crate in cargo's cache (is it pinned in Cargo.toml?)" >&2; exit 1; }
    local inner="$name/${3%/}" dest="third_party/$4"
    local strip; strip=$(($(tr -cd / <<<"$inner" | wc -c)))
    mkdir -p "$(dirname "$dest")"
    local tmp; tmp=$(mktemp -d "$(dirname "$dest")/.unpack.XXXXXX")
    tar -xzf "$archive" -C "$tmp" --strip-components="$strip" "$inner"
    rm -rf "$dest"; mv "$tmp/$(basename "$inner")" "$dest"; rm -rf "$tmp"
}

while IFS=$'\t' read -r package version member dest; do
    case "$package" in ''|'#'*) continue ;; esac
    [ -e "third_party/$dest" ] || unpack "$package" "$version" "$member" "$dest"
done < "$root/scripts/third-party.tsv"
echo "third_party/ ready"
