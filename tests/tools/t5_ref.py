#!/usr/bin/env python3
"""Independent numpy model of the T5 v1.1 encoder (Hugging Face T5EncoderModel semantics),
for checking src/models/te/t5.rs.

Usage:
  t5_ref.py WEIGHTS.safetensors CASES.json OUTDIR
      WEIGHTS has T5EncoderModel names (shared.weight, encoder.block.N...). For each case
      {"name", "tokens": [ids], "mask": [1/0 per token] (optional)} write OUTDIR/NAME.f32:
      the final hidden states [n_token, d_model] (row-major, little-endian f32).

Written from the published architecture: pre-norm blocks with RMS norms (eps 1e-6),
unscaled dot-product attention plus a bucketed relative position bias taken from the first
block (32 buckets, bidirectional, max distance 128; the buckets here come from exact integer
arithmetic), padding keys masked out, and a gated tanh-GELU feed-forward. The sums run in
float64, with the rounding steps of the ggml graph under test: inputs of products with f16
weights are rounded to f16 (the feed-forward output projection sees them divided by 32 first,
as there), and GELU is read from ggml's f16 table (f16 in, f16 out).
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from unet_ref import UNet, f16  # noqa: E402  (ggml's f16 rounding and GELU table)
from vae_ref import load_safetensors  # noqa: E402

gelu_table = UNet.gelu_table


def linear(x, w, pre_scale=1.0):
    """x @ w.T with x rounded to f16 like ggml's f16 matrix products (after the scaling)."""
    return (f16(x * pre_scale) @ w.astype(np.float64).T) / pre_scale


def rms_norm(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w.astype(np.float64)


def bucket(rel):
    """Bidirectional bucket of key - query distance `rel` (32 buckets, max distance 128)."""
    base = 16 if rel > 0 else 0
    d = abs(rel)
    if d < 8:
        return base + d
    # 8 + floor(8 * log(d / 8) / log(16)) = 8 + floor(log2(d^2 / 64)), exactly
    return base + min(8 + (d * d).bit_length() - 1 - 6, 15)


def position_bias(table, n):
    rel = np.arange(n)[None, :] - np.arange(n)[:, None]  # [query, key]
    idx = np.vectorize(bucket)(rel)
    return table.astype(np.float64)[idx].transpose(2, 0, 1)  # [heads, query, key]


def encode(w, tokens, mask):
    n = len(tokens)
    x = w["shared.weight"][np.array(tokens)].astype(np.float64)
    heads = w["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape[1]
    bias = position_bias(w["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"], n)
    if mask is not None:
        bias = bias + np.where(np.array(mask)[None, None, :] > 0, 0.0, -np.inf)
    layers = 1 + max(int(k.split(".")[2]) for k in w if k.startswith("encoder.block."))
    for i in range(layers):
        p = f"encoder.block.{i}.layer."
        h = rms_norm(x, w[p + "0.layer_norm.weight"])
        q = linear(h, w[p + "0.SelfAttention.q.weight"])
        k = linear(h, w[p + "0.SelfAttention.k.weight"])
        v = linear(h, w[p + "0.SelfAttention.v.weight"])
        dh = q.shape[1] // heads
        q, k, v = (t.reshape(n, heads, dh).transpose(1, 0, 2) for t in (q, k, v))
        s = q @ k.transpose(0, 2, 1) + bias
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        o = (s @ v).transpose(1, 0, 2).reshape(n, heads * dh)
        x = x + linear(o, w[p + "0.SelfAttention.o.weight"])
        h = rms_norm(x, w[p + "1.layer_norm.weight"])
        g = gelu_table(linear(h, w[p + "1.DenseReluDense.wi_0.weight"]))
        u = linear(h, w[p + "1.DenseReluDense.wi_1.weight"])
        x = x + linear(g * u, w[p + "1.DenseReluDense.wo.weight"], pre_scale=1.0 / 32.0)
    return rms_norm(x, w["encoder.final_layer_norm.weight"])


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    weights, cases, outdir = sys.argv[1:]
    w = load_safetensors(weights)
    for case in json.load(open(cases)):
        y = encode(w, case["tokens"], case.get("mask"))
        tmp = os.path.join(outdir, case["name"] + ".f32.tmp")
        y.astype("<f4").tofile(tmp)
        os.replace(tmp, os.path.join(outdir, case["name"] + ".f32"))


if __name__ == "__main__":
    main()
