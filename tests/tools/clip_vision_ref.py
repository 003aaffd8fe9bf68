#!/usr/bin/env python3
"""Independent numpy model of the CLIP vision tower (Hugging Face CLIPVisionModelWithProjection
semantics), for checking src/models/te/clip_vision.rs on tests/fixtures' clip_vision_h.safetensors.

It reads the weights from the file itself (Hugging Face names, as written by synth_video.py's
clip-vision-h), one layer at a time, and computes in float32 (the weights are f16 values, exact
in f32). The image preprocessing is written here from the reference's description: scale by
nearest neighbour (source index = out * in // out_size) to cover the square, centre crop, clamp
to [0, 1], (v - mean) / std in float32.

Usage:
  clip_vision_ref.py run WEIGHTS.safetensors CASES.json OUTDIR
      for each case {"name", "image": PATH, "width": W, "height": H, "layers": N, "pooled": bool}
      (PATH: raw little-endian f32, channel planes of H rows of W values, RGB in [0, 1]) write
      OUTDIR/NAME.f32: the hidden states after N layers, [tokens, width] row-major, no
      post-layernorm; or with "pooled" the post-layernormed class token through
      visual_projection.
"""
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clip_reference import gelu_tanh, layer_norm, quick_gelu  # noqa: E402

MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)
HEADS = 16


class File:
    def __init__(self, path):
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            self.header = json.loads(f.read(n))
        self.base = 8 + n
        self.path = path

    def get(self, name):
        h = self.header[name]
        assert h["dtype"] == "F16", (name, h["dtype"])
        a, b = h["data_offsets"]
        raw = np.memmap(self.path, dtype=np.float16, mode="r", offset=self.base + a, shape=((b - a) // 2,))
        return np.asarray(raw, dtype=np.float32).reshape(h["shape"])


def preprocess(img, size):
    """img: [3, H, W] float32 -> [3, size, size]."""
    _, h, w = img.shape
    scale = max(np.float32(size) / np.float32(w), np.float32(size) / np.float32(h))
    rw, rh = int(np.float32(scale) * np.float32(w)), int(np.float32(scale) * np.float32(h))
    dx, dy = max((rw - size) // 2, 0), max((rh - size) // 2, 0)
    xs = np.minimum((np.arange(size) + dx) * w // rw, w - 1)
    ys = np.minimum((np.arange(size) + dy) * h // rh, h - 1)
    out = np.clip(img[:, ys][:, :, xs], np.float32(0), np.float32(1))
    return ((out - MEAN[:, None, None]) / STD[:, None, None]).astype(np.float32)


def linear(f, p, x, bias=True):
    y = x @ f.get(p + ".weight").T
    return y + f.get(p + ".bias") if bias else y


def attention(f, p, x):
    n, d = x.shape
    hd = d // HEADS
    q, k, v = (linear(f, f"{p}.{n_}_proj", x).reshape(n, HEADS, hd).transpose(1, 0, 2) for n_ in "qkv")
    s = q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(hd))
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    o = (s @ v).transpose(1, 0, 2).reshape(n, d)
    return linear(f, p + ".out_proj", o)


def run(f, pixels, layers, pooled):
    v = "vision_model."
    w = f.get(v + "embeddings.patch_embedding.weight")          # [d, 3, p, p]
    d, c, p, _ = w.shape
    g = pixels.shape[1] // p
    patches = pixels.reshape(c, g, p, g, p).transpose(1, 3, 0, 2, 4).reshape(g * g, c * p * p)
    x = patches @ w.reshape(d, -1).T
    x = np.concatenate([f.get(v + "embeddings.class_embedding")[None], x], 0)
    x = x + f.get(v + "embeddings.position_embedding.weight")
    x = layer_norm(x, f.get(v + "pre_layrnorm.weight"), f.get(v + "pre_layrnorm.bias"))
    act = gelu_tanh if d in (1024, 1280) else quick_gelu        # the reference decides by width
    for i in range(layers):
        b = f"{v}encoder.layers.{i}."
        h = layer_norm(x, f.get(b + "layer_norm1.weight"), f.get(b + "layer_norm1.bias"))
        x = x + attention(f, b + "self_attn", h)
        h = layer_norm(x, f.get(b + "layer_norm2.weight"), f.get(b + "layer_norm2.bias"))
        x = x + linear(f, b + "mlp.fc2", act(linear(f, b + "mlp.fc1", h)))
    if not pooled:
        return x
    x = layer_norm(x, f.get(v + "post_layernorm.weight"), f.get(v + "post_layernorm.bias"))
    return linear(f, "visual_projection", x[0], bias=False)


def main(argv):
    if len(argv) != 4 or argv[0] != "run":
        raise SystemExit(__doc__)
    f = File(argv[1])
    size = int(np.sqrt(f.header["vision_model.embeddings.position_embedding.weight"]["shape"][0] - 1)) * \
        f.header["vision_model.embeddings.patch_embedding.weight"]["shape"][2]
    with open(argv[2]) as fh:
        cases = json.load(fh)
    for case in cases:
        img = np.fromfile(case["image"], dtype="<f4").reshape(3, case["height"], case["width"])
        out = run(f, preprocess(img, size), case["layers"], case.get("pooled", False))
        out.astype("<f4").tofile(os.path.join(argv[3], case["name"] + ".f32"))


if __name__ == "__main__":
    main(sys.argv[1:])
