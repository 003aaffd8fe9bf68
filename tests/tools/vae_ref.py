#!/usr/bin/env python3
"""Independent numpy implementation of the SD autoencoders, to check our ggml graphs.

Usage:
  vae_ref.py kl-decode WEIGHTS IN OUT   VAE-space latent -> image in about [-1, 1]
  vae_ref.py kl-encode WEIGHTS IN OUT   image in [-1, 1] -> moments (mean, logvar)
  vae_ref.py tae-decode WEIGHTS IN OUT  TAESD: latent -> image in about [0, 1]
  vae_ref.py tae-encode WEIGHTS IN OUT  TAESD: image in [0, 1] -> latent
  vae_ref.py png PNG - OUT              8-bit PNG -> [W, H, C, 1] tensor of 0..255 values

WEIGHTS is a safetensors file with the checkpoint names (first_stage_model.* for the VAE,
encoder.layers.* / decoder.layers.* for TAESD). Tensors are exchanged in the golden
latent format: int32 ndim, int64 shape[ndim] in ggml order (W, H, C, N), float32 data.

Written from the published architectures (ldm AutoencoderKL, madebyollin/taesd), in
float32 with one precision detail of the graphs under test: convolution inputs are
rounded to float16 (ggml's im2col runs in the f16 type of the weights).
"""
import json
import struct
import sys
import zlib

import numpy as np


def load_safetensors(path, prefix=""):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    kinds = {"F16": np.float16, "F32": np.float32}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        if info["dtype"] == "BF16":
            u = np.frombuffer(raw[base + a:base + b], dtype=np.uint16).astype(np.uint32) << 16
            arr = u.view(np.float32)
        else:
            arr = np.frombuffer(raw[base + a:base + b], dtype=kinds[info["dtype"]])
        out[prefix + name] = arr.reshape(info["shape"])
    return out


def read_tensor(path):
    with open(path, "rb") as f:
        raw = f.read()
    (nd,) = struct.unpack("<i", raw[:4])
    shape = struct.unpack("<%dq" % nd, raw[4:4 + 8 * nd])
    data = np.frombuffer(raw[4 + 8 * nd:], dtype=np.float32)
    shape = list(shape) + [1] * (4 - nd)
    return data.reshape(shape[::-1]).astype(np.float32)  # N, C, H, W


def write_tensor(path, x):
    shape = list(x.shape[::-1])
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(shape)))
        f.write(struct.pack("<%dq" % len(shape), *shape))
        f.write(np.ascontiguousarray(x, dtype=np.float32).tobytes())


class Net:
    def __init__(self, weights):
        self.w = weights

    def p(self, name):
        return self.w[name].astype(np.float32)

    def conv(self, name, x, stride=1, pad=1, bias=True):
        w = self.w[name + ".weight"].astype(np.float16).astype(np.float32)
        if w.ndim == 2:
            w = w[:, :, None, None]
        x = x.astype(np.float16).astype(np.float32)
        if pad:
            x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
        kh, kw = w.shape[2], w.shape[3]
        win = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))[:, :, ::stride, ::stride]
        y = np.tensordot(win, w, axes=([1, 4, 5], [1, 2, 3])).transpose(0, 3, 1, 2)
        if bias:
            y = y + self.p(name + ".bias")[None, :, None, None]
        return y.astype(np.float32)

    def group_norm(self, name, x, groups=32, eps=1e-6):
        n, c, h, w = x.shape
        g = x.reshape(n, groups, -1).astype(np.float64)
        mean = g.mean(axis=2, keepdims=True)
        var = ((g - mean) ** 2).mean(axis=2, keepdims=True)
        y = ((g - mean) / np.sqrt(var + eps)).reshape(n, c, h, w).astype(np.float32)
        return y * self.p(name + ".weight")[None, :, None, None] + self.p(name + ".bias")[None, :, None, None]


def silu(x):
    return x / (1.0 + np.exp(-x))


def relu(x):
    return np.maximum(x, 0)


def up2(x):
    return x.repeat(2, axis=2).repeat(2, axis=3)


class KL(Net):
    """ldm.models.autoencoder.AutoencoderKL, SD configuration."""

    mult = (1, 2, 4, 4)
    res_blocks = 2

    def resnet(self, name, x):
        h = self.conv(name + ".conv1", silu(self.group_norm(name + ".norm1", x)))
        h = self.conv(name + ".conv2", silu(self.group_norm(name + ".norm2", h)))
        if name + ".nin_shortcut.weight" in self.w:
            x = self.conv(name + ".nin_shortcut", x, pad=0)
        return h + x

    def proj(self, name, t):
        """t: N, L, C tokens. A 1x1 conv or a linear layer: with f16 weights the input is
        rounded to f16 too (im2col, or ggml's conversion of mul_mat operands)."""
        w = self.w[name + ".weight"]
        if w.dtype == np.float16 or w.ndim == 4:
            t = t.astype(np.float16).astype(np.float32)
        w = w.astype(np.float16 if w.ndim == 4 else w.dtype).astype(np.float32)
        if w.ndim == 4:
            w = w[:, :, 0, 0]
        return t @ w.T + self.p(name + ".bias")

    def attn(self, name, x):
        n, c, h, w = x.shape
        t = self.group_norm(name + ".norm", x).reshape(n, c, h * w).transpose(0, 2, 1)
        q, k, v = (self.proj(name + "." + s, t) for s in "qkv")
        s = (q.astype(np.float64) @ k.transpose(0, 2, 1)) / np.sqrt(c)
        s = np.exp(s - s.max(axis=2, keepdims=True))
        s /= s.sum(axis=2, keepdims=True)
        o = (s @ v).astype(np.float32)
        o = self.proj(name + ".proj_out", o)
        return o.transpose(0, 2, 1).reshape(n, c, h, w) + x

    def mid(self, pre, h):
        h = self.resnet(pre + "mid.block_1", h)
        h = self.attn(pre + "mid.attn_1", h)
        return self.resnet(pre + "mid.block_2", h)

    def encode(self, x):
        pre = "first_stage_model.encoder."
        h = self.conv(pre + "conv_in", x)
        for i in range(len(self.mult)):
            for j in range(self.res_blocks):
                h = self.resnet(pre + "down.%d.block.%d" % (i, j), h)
            if i != len(self.mult) - 1:
                h = np.pad(h, ((0, 0), (0, 0), (0, 1), (0, 1)))
                h = self.conv(pre + "down.%d.downsample.conv" % i, h, stride=2, pad=0)
        h = self.mid(pre, h)
        h = self.conv(pre + "conv_out", silu(self.group_norm(pre + "norm_out", h)))
        return self.conv("first_stage_model.quant_conv", h, pad=0)

    def decode(self, z):
        pre = "first_stage_model.decoder."
        z = self.conv("first_stage_model.post_quant_conv", z, pad=0)
        h = self.conv(pre + "conv_in", z)
        h = self.mid(pre, h)
        for i in reversed(range(len(self.mult))):
            for j in range(self.res_blocks + 1):
                h = self.resnet(pre + "up.%d.block.%d" % (i, j), h)
            if i != 0:
                h = self.conv(pre + "up.%d.upsample.conv" % i, up2(h))
        return self.conv(pre + "conv_out", silu(self.group_norm(pre + "norm_out", h)))


class TAESD(Net):
    """madebyollin/taesd: Encoder/Decoder as nn.Sequential."""

    def block(self, name, x):
        h = relu(self.conv(name + ".conv.0", x))
        h = relu(self.conv(name + ".conv.2", h))
        h = self.conv(name + ".conv.4", h)
        return relu(h + x)

    def decode(self, z):
        pre = "decoder.layers."
        h = np.tanh(z / 3.0) * 3.0
        h = relu(self.conv(pre + "0", h))
        i = 2
        for _ in range(3):
            for _ in range(3):
                h = self.block(pre + str(i), h)
                i += 1
            h = self.conv(pre + str(i + 1), up2(h), bias=False)
            i += 2
        h = self.block(pre + str(i), h)
        return self.conv(pre + str(i + 1), h)

    def encode(self, x):
        pre = "encoder.layers."
        h = self.conv(pre + "0", x)
        h = self.block(pre + "1", h)
        i = 2
        for _ in range(3):
            h = self.conv(pre + str(i), h, stride=2, bias=False)
            i += 1
            for _ in range(3):
                h = self.block(pre + str(i), h)
                i += 1
        return self.conv(pre + str(i), h)


def decode_png(path):
    """An 8-bit non-interlaced PNG as (width, height, channels, uint8 rows [h, w * channels])."""
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    while pos < len(raw):
        (n,) = struct.unpack(">I", raw[pos:pos + 4])
        kind = raw[pos + 4:pos + 8]
        body = raw[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and interlace == 0, "only 8-bit non-interlaced PNGs"
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    ch = {0: 1, 2: 3, 4: 2, 6: 4}[ctype]
    data = zlib.decompress(idat)
    stride = w * ch
    img = np.zeros((h, stride), dtype=np.int32)
    prev = np.zeros(stride, dtype=np.int32)
    for y in range(h):
        ftype = data[y * (stride + 1)]
        row = np.frombuffer(data, dtype=np.uint8, count=stride, offset=y * (stride + 1) + 1).astype(np.int32)
        if ftype == 0:
            cur = row
        elif ftype == 2:
            cur = (row + prev) & 255
        else:
            cur = row.copy()
            for x in range(stride):
                a = cur[x - ch] if x >= ch else 0
                b = prev[x]
                c = prev[x - ch] if x >= ch else 0
                if ftype == 1:
                    pred = a
                elif ftype == 3:
                    pred = (a + b) // 2
                else:
                    pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                cur[x] = (row[x] + pred) & 255
        img[y] = cur
        prev = cur
    return w, h, ch, img.astype(np.uint8)


def read_png(path):
    w, h, ch, img = decode_png(path)
    return img.reshape(h, w, ch).transpose(2, 0, 1)[None].astype(np.float32)  # N, C, H, W


def main(argv):
    if len(argv) != 4:
        raise SystemExit(__doc__)
    cmd, weights, inp, out = argv
    if cmd == "png":
        write_tensor(out, read_png(weights))
        return
    x = read_tensor(inp)
    if cmd.startswith("kl-"):
        net = KL(load_safetensors(weights))
    else:
        net = TAESD(load_safetensors(weights))
    y = net.decode(x) if cmd.endswith("decode") else net.encode(x)
    write_tensor(out, y)


if __name__ == "__main__":
    main(sys.argv[1:])
