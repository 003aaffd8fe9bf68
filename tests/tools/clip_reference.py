#!/usr/bin/env python3
"""Independent numpy model of the CLIP text encoders, for checking src/models/te/clip.rs.

The weights are those of tests/fixtures/synth_model.py (a pure function of tensor name
and index, stored as f16). The model works in the checkpoint's own naming and torch
semantics (HF CLIP for SD 1.x / CLIP-L, OpenCLIP for SD 2.x / bigG) in float64, so it
also checks the name mapping of the Rust test loader.

Usage:
  clip_reference.py weights ARCH OUT.safetensors
      write only the text-encoder tensors of ARCH (same names and bytes as the full
      checkpoint), to a temporary name then renamed.
  clip_reference.py run ARCH WEIGHTS.safetensors|- CASES.json OUTDIR
      for each case {"name", "tokens", "clip_skip", "final_ln", "pooled", "custom_n"}
      write OUTDIR/NAME.f32: the hidden states [n_token, dim] (row-major, little-endian
      f32) of the token sequence, or with "pooled": IDX the projected pooled vector.
      "custom_n": N appends N textual-inversion rows (see custom_table) that ids >= vocab
      look up. "-" recomputes the weights instead of reading a file.

ARCH: sd1 (CLIP-L, quick_gelu), sd2 (OpenCLIP-H, gelu), tiny-g (a 3-layer, 64-wide
OpenCLIP with text_projection: the bigG code path at a size a test can afford).
"""
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures"))
import synth_model as sm  # noqa: E402

ARCHS = {
    # name: (spec builder, prefix in the checkpoint, layers, width, heads, OpenCLIP layout + gelu)
    "sd1": (lambda s: sm.clip_text(s), "cond_stage_model.transformer.text_model.", 12, 768, 12, False),
    "sd2": (lambda s: sm.openclip_text(s), "cond_stage_model.model.", 24, 1024, 16, True),
    "tiny-g": (lambda s: sm.openclip_text(s, pre="conditioner.embedders.1.model.", d=64, layers=3, vocab=49408, ff=256),
               "conditioner.embedders.1.model.", 3, 64, 4, True),
}


def spec(arch):
    s = sm.Spec()
    ARCHS[arch][0](s)
    return s.t


def weights(arch):
    """name -> f32 array, rounded through f16 like the files."""
    return {n: sm.value(n, sh).astype(np.float16).astype(np.float32) for n, sh in spec(arch).items()}


def layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def quick_gelu(x):
    return x / (1.0 + np.exp(-1.702 * x))


def attention(x, wq, bq, wk, bk, wv, bv, wo, bo, heads):
    n, d = x.shape
    dh = d // heads
    q = (x @ wq.T + bq).reshape(n, heads, dh).transpose(1, 0, 2)
    k = (x @ wk.T + bk).reshape(n, heads, dh).transpose(1, 0, 2)
    v = (x @ wv.T + bv).reshape(n, heads, dh).transpose(1, 0, 2)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(dh)
    s = s + np.triu(np.full((n, n), -np.inf), 1)  # causal: a token sees itself and earlier ones
    s = np.exp(s - s.max(-1, keepdims=True))
    s = s / s.sum(-1, keepdims=True)
    o = (s @ v).transpose(1, 0, 2).reshape(n, d)
    return o @ wo.T + bo


def forward(arch, w, tokens, clip_skip, final_ln, pooled_idx, custom):
    _, pre, n_layer, d, heads, openclip = ARCHS[arch]
    if openclip:
        tok, pos = w[pre + "token_embedding.weight"], w[pre + "positional_embedding"]
    else:
        tok, pos = w[pre + "embeddings.token_embedding.weight"], w[pre + "embeddings.position_embedding.weight"]
    if custom is not None:
        tok = np.concatenate([tok, custom], 0)
    x = (tok[np.asarray(tokens)] + pos).astype(np.float64)
    if pooled_idx is not None:
        clip_skip = 1
    # The reference counts clip_skip from the end; it runs every layer when the index
    # falls below -1 and none when it is exactly -1.
    last = n_layer - 1 if clip_skip <= 0 else n_layer - clip_skip
    n_run = last + 1 if 0 <= last + 1 <= n_layer else n_layer
    for i in range(n_run):
        if openclip:
            p = f"{pre}transformer.resblocks.{i}."
            wi, bi = w[p + "attn.in_proj_weight"], w[p + "attn.in_proj_bias"]
            qkv = (wi[:d], bi[:d], wi[d:2 * d], bi[d:2 * d], wi[2 * d:], bi[2 * d:])
            h = layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"])
            x = x + attention(h, *qkv, w[p + "attn.out_proj.weight"], w[p + "attn.out_proj.bias"], heads)
            h = layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"])
            h = gelu_tanh(h @ w[p + "mlp.c_fc.weight"].T + w[p + "mlp.c_fc.bias"])
            x = x + h @ w[p + "mlp.c_proj.weight"].T + w[p + "mlp.c_proj.bias"]
        else:
            p = f"{pre}encoder.layers.{i}."
            a = p + "self_attn."
            qkv = [w[a + f"{n}_proj.{k}"] for n in "qkv" for k in ("weight", "bias")]
            h = layer_norm(x, w[p + "layer_norm1.weight"], w[p + "layer_norm1.bias"])
            x = x + attention(h, *qkv, w[a + "out_proj.weight"], w[a + "out_proj.bias"], heads)
            h = layer_norm(x, w[p + "layer_norm2.weight"], w[p + "layer_norm2.bias"])
            h = quick_gelu(h @ w[p + "mlp.fc1.weight"].T + w[p + "mlp.fc1.bias"])
            x = x + h @ w[p + "mlp.fc2.weight"].T + w[p + "mlp.fc2.bias"]
    if final_ln or pooled_idx is not None:
        ln = pre + ("ln_final." if openclip else "final_layer_norm.")
        x = layer_norm(x, w[ln + "weight"], w[ln + "bias"])
    if pooled_idx is not None:
        # The reference multiplies by text_projection as a ggml matrix: with OpenCLIP's
        # [width, proj] layout that is P @ x (OpenCLIP itself computes x @ P).
        return w[pre + "text_projection"] @ x[pooled_idx]
    return x


def custom_table(n, d):
    """The extra embedding rows the Rust test builds too: 0.02 * sin(1 + 0.37 i + 1.3 j)."""
    j, i = np.meshgrid(np.arange(n), np.arange(d), indexing="ij")
    return (0.02 * np.sin(1.0 + 0.37 * i + 1.3 * j)).astype(np.float32)


def read_safetensors(path):
    """name -> f32 array of a safetensors file (memory-mapped)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    dtypes = {"F16": np.float16, "F32": np.float32}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = raw[a:b].view(dtypes[info["dtype"]]).reshape(info["shape"]).astype(np.float32)
    return out


def main(argv):
    if len(argv) == 3 and argv[0] == "weights":
        arch, out = argv[1], argv[2]
        tmp = out + ".tmp%d" % os.getpid()
        sm.write_safetensors(tmp, spec(arch), "f16")
        os.replace(tmp, out)
        return
    if len(argv) == 5 and argv[0] == "run":
        arch, weights_path, cases_path, outdir = argv[1:]
        w = read_safetensors(weights_path) if weights_path != "-" else weights(arch)
        with open(cases_path) as f:
            cases = json.load(f)
        for c in cases:
            custom = custom_table(c["custom_n"], ARCHS[arch][3]) if c.get("custom_n") else None
            y = forward(arch, w, c["tokens"], c.get("clip_skip", -1), c.get("final_ln", True), c.get("pooled"), custom)
            y.astype("<f4").tofile(os.path.join(outdir, c["name"] + ".f32"))
        return
    raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
