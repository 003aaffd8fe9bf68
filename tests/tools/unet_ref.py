#!/usr/bin/env python3
"""Independent numpy model of the SD 1.x / 2.x / SDXL UNet, to check our ggml graph.

Usage: unet_ref.py WEIGHTS.safetensors CASE_DIR

CASE_DIR/case.json names the variant ("sd1", "sd2", "sdxl"), the tensor name prefix, the
control strength and the inputs, each a raw little-endian f32 file in CASE_DIR with its
shape in torch order (x: N,C,H,W; timesteps: N; context: N,L,D; c_concat: N,C',H,W;
y: N,ADM; controls: list of N,C,H,W). Writes CASE_DIR/expected.bin (f32, N,C,H,W). With
"dump_blocks" it also writes each block's output (emb, skip<i> per input block, mid,
out<k> per output block, before controls are added) and their shapes in dumped.json.

Written from the papers' description of the architecture (openaimodel.py layout) in NCHW,
computing in float64 but rounding matmul inputs to f16 where ggml does (f16 weights: conv
im2col and linear inputs) and using ggml's f16-table GELU, so the expected error against a
correct ggml graph is small (~1e-3 relative).
"""
import json
import os
import sys

import numpy as np


class Weights:
    def __init__(self, path, prefix):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            self.header = json.loads(f.read(n))
        self.base = 8 + n
        self.mm = np.memmap(path, dtype=np.uint8, mode="r")
        self.prefix = prefix

    def has(self, name):
        return (self.prefix + name) in self.header

    def raw(self, name):
        """(array in the file's dtype, is_f16)."""
        info = self.header[self.prefix + name]
        dt = {"F16": np.float16, "F32": np.float32}[info["dtype"]]
        a, b = info["data_offsets"]
        arr = np.frombuffer(self.mm[self.base + a:self.base + b].tobytes(), dtype=dt).reshape(info["shape"])
        return arr, dt == np.float16

    def __call__(self, name):
        return self.raw(name)[0].astype(np.float64)


def f16(x):
    """Round through f16 the way ggml converts f32 activations (via f32)."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float64)


def f32(x):
    return np.asarray(x, dtype=np.float32).astype(np.float64)


class UNet:
    def __init__(self, w, variant):
        self.w = w
        self.variant = variant
        if variant == "sdxl":
            self.mult, self.attn_ds = (1, 2, 4), (2, 4)
        else:
            self.mult, self.attn_ds = (1, 2, 4, 4), (1, 2, 4)
        self.nres = 2
        self.mc = w.raw("time_embed.0.weight")[0].shape[1]
        self.dump_dir = None
        self.dumped = {}

    def heads(self, ch):
        if self.variant == "sd1":
            return 8, ch // 8
        return ch // 64, 64

    # ---- layers
    def linear(self, p, x, bias=True):
        wt, is16 = self.w.raw(p + ".weight")
        xin = f16(x) if is16 else f32(x)
        y = xin @ wt.astype(np.float64).T
        if bias:
            y = y + self.w(p + ".bias")
        return f32(y)

    def conv(self, p, x, stride=1, pad=None):
        wt = self.w.raw(p + ".weight")[0].astype(np.float16).astype(np.float64)  # conv weights are f16
        o, i, kh, kw = wt.shape
        if pad is None:
            pad = kh // 2
        xp = np.pad(f16(x), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
        n, _, hp, wp = xp.shape
        ho = (hp - kh) // stride + 1
        wo = (wp - kw) // stride + 1
        cols = np.empty((n, i, kh, kw, ho, wo))
        for a in range(kh):
            for b in range(kw):
                cols[:, :, a, b] = xp[:, :, a:a + stride * ho:stride, b:b + stride * wo:stride]
        y = np.einsum("nikluv,oikl->nouv", cols, wt, optimize=True)
        y = y + self.w(p + ".bias")[None, :, None, None]
        return f32(y)

    def group_norm(self, p, x, groups=32, eps=1e-6):
        n, c, h, wd = x.shape
        xg = x.reshape(n, groups, -1)
        mean = xg.mean(-1, keepdims=True)
        var = ((xg - mean) ** 2).mean(-1, keepdims=True)
        y = ((xg - mean) / np.sqrt(var + eps)).reshape(n, c, h, wd)
        return f32(y * self.w(p + ".weight")[None, :, None, None] + self.w(p + ".bias")[None, :, None, None])

    def layer_norm(self, p, x, eps=1e-5):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return f32((x - mean) / np.sqrt(var + eps) * self.w(p + ".weight") + self.w(p + ".bias"))

    @staticmethod
    def silu(x):
        return f32(x / (1.0 + np.exp(-x)))

    @staticmethod
    def gelu_table(x):
        """ggml's f32 GELU: tanh approximation looked up at the f16-rounded input, f16 result."""
        xi = f16(x)
        g = 0.5 * xi * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * xi * (1.0 + 0.044715 * xi * xi)))
        y = f16(g)
        y = np.where(x <= -10.0, 0.0, y)
        return np.where(x >= 10.0, x, y)

    def dump(self, name, a):
        """Saves an intermediate (f32, torch order) when the case asks for block outputs."""
        if self.dump_dir is not None:
            np.asarray(a, dtype="<f4").tofile(os.path.join(self.dump_dir, name + ".bin"))
            self.dumped[name] = list(a.shape)

    # ---- blocks
    def resblock(self, p, x, emb):
        h = self.conv(p + ".in_layers.2", self.silu(self.group_norm(p + ".in_layers.0", x)))
        e = self.linear(p + ".emb_layers.1", self.silu(emb))
        h = f32(h + e[:, :, None, None])
        h = self.conv(p + ".out_layers.3", self.silu(self.group_norm(p + ".out_layers.0", h)))
        if self.w.has(p + ".skip_connection.weight"):
            x = self.conv(p + ".skip_connection", x, pad=0)
        return f32(h + x)

    def attention(self, p, x, ctx, n_head):
        q = self.linear(p + ".to_q", x, bias=False)
        k = self.linear(p + ".to_k", ctx, bias=False)
        v = self.linear(p + ".to_v", ctx, bias=False)
        n, lq, c = q.shape
        d = c // n_head
        q = q.reshape(n, lq, n_head, d).transpose(0, 2, 1, 3)
        k = k.reshape(n, -1, n_head, d).transpose(0, 2, 1, 3)
        v = v.reshape(n, -1, n_head, d).transpose(0, 2, 1, 3)
        s = f32(q @ k.transpose(0, 1, 3, 2)) * f32(1.0 / np.sqrt(d))
        s = s - s.max(-1, keepdims=True)
        pr = np.exp(s)
        pr = f32(pr / pr.sum(-1, keepdims=True))
        o = f32(pr @ v).transpose(0, 2, 1, 3).reshape(n, lq, c)
        return self.linear(p + ".to_out.0", o)

    def feed_forward(self, p, x):
        h = self.linear(p + ".net.0.proj", x)
        a, gate = np.split(h, 2, axis=-1)
        return self.linear(p + ".net.2", f32(a * self.gelu_table(gate)))

    def transformer(self, p, x, ctx):
        n, c, h, wd = x.shape
        n_head, _ = self.heads(c)
        t = self.group_norm(p + ".norm", x)
        conv_proj = self.w.raw(p + ".proj_in.weight")[0].ndim == 4
        if conv_proj:
            t = self.conv(p + ".proj_in", t, pad=0).transpose(0, 2, 3, 1).reshape(n, h * wd, c)
        else:
            t = self.linear(p + ".proj_in", t.transpose(0, 2, 3, 1).reshape(n, h * wd, c))
        d = 0
        while self.w.has(f"{p}.transformer_blocks.{d}.norm1.weight"):
            b = f"{p}.transformer_blocks.{d}"
            n1 = self.layer_norm(b + ".norm1", t)
            t = f32(self.attention(b + ".attn1", n1, n1, n_head) + t)
            t = f32(self.attention(b + ".attn2", self.layer_norm(b + ".norm2", t), ctx, n_head) + t)
            t = f32(self.feed_forward(b + ".ff", self.layer_norm(b + ".norm3", t)) + t)
            d += 1
        if conv_proj:
            t = self.conv(p + ".proj_out", t.reshape(n, h, wd, c).transpose(0, 3, 1, 2), pad=0)
        else:
            t = self.linear(p + ".proj_out", t).reshape(n, h, wd, c).transpose(0, 3, 1, 2)
        return f32(t + x)

    def timestep_embedding(self, ts):
        half = self.mc // 2
        j = np.arange(half, dtype=np.float32)
        freqs = np.exp(-np.log(np.float32(10000.0)) * j / np.float32(half)).astype(np.float32)
        args = ts.astype(np.float32)[:, None] * freqs[None]
        return f32(np.concatenate([np.cos(args), np.sin(args)], axis=-1))

    def forward(self, x, ts, ctx, c_concat=None, y=None, controls=(), strength=1.0):
        n = x.shape[0]
        ctx = np.broadcast_to(ctx, (n,) + ctx.shape[1:])
        if y is not None:
            y = np.broadcast_to(y, (n,) + y.shape[1:])
        if c_concat is not None:
            x = np.concatenate([x, np.broadcast_to(c_concat, (x.shape[0],) + c_concat.shape[1:])], axis=1)
        emb = self.linear("time_embed.2", self.silu(self.linear("time_embed.0", self.timestep_embedding(ts))))
        if y is not None:
            emb = f32(emb + self.linear("label_emb.0.2", self.silu(self.linear("label_emb.0.0", y))))
        self.dump("emb", emb)
        h = self.conv("input_blocks.0.0", x)
        hs = [h]
        self.dump("skip0", h)
        idx, ds = 1, 1
        for lvl, _ in enumerate(self.mult):
            for _ in range(self.nres):
                h = self.resblock(f"input_blocks.{idx}.0", h, emb)
                if ds in self.attn_ds:
                    h = self.transformer(f"input_blocks.{idx}.1", h, ctx)
                hs.append(h)
                self.dump(f"skip{idx}", h)
                idx += 1
            if lvl != len(self.mult) - 1:
                h = self.conv(f"input_blocks.{idx}.0.op", h, stride=2)
                hs.append(h)
                self.dump(f"skip{idx}", h)
                idx += 1
                ds *= 2
        h = self.resblock("middle_block.0", h, emb)
        h = self.transformer("middle_block.1", h, ctx)
        h = self.resblock("middle_block.2", h, emb)
        self.dump("mid", h)
        controls = list(controls)
        if controls:
            h = f32(h + controls.pop() * strength)
        idx = 0
        for lvl in reversed(range(len(self.mult))):
            for i in range(self.nres + 1):
                skip = hs.pop()
                if controls:
                    skip = f32(skip + controls.pop() * strength)
                h = self.resblock(f"output_blocks.{idx}.0", np.concatenate([h, skip], axis=1), emb)
                sub = 1
                if ds in self.attn_ds:
                    h = self.transformer(f"output_blocks.{idx}.1", h, ctx)
                    sub = 2
                if lvl != 0 and i == self.nres:
                    h = h.repeat(2, axis=2).repeat(2, axis=3)
                    h = self.conv(f"output_blocks.{idx}.{sub}.conv", h)
                    ds //= 2
                self.dump(f"out{idx}", h)
                idx += 1
        h = self.silu(self.group_norm("out.0", h))
        return self.conv("out.2", h)


def main(argv):
    weights, case_dir = argv
    with open(os.path.join(case_dir, "case.json")) as f:
        case = json.load(f)

    def load(entry):
        if entry is None:
            return None
        a = np.fromfile(os.path.join(case_dir, entry["file"]), dtype="<f4").reshape(entry["shape"])
        return a.astype(np.float64)

    w = Weights(weights, case["prefix"])
    net = UNet(w, case["variant"])
    if case.get("dump_blocks"):
        net.dump_dir = case_dir
    out = net.forward(
        load(case["x"]),
        load(case["timesteps"]),
        load(case["context"]),
        load(case.get("c_concat")),
        load(case.get("y")),
        [load(c) for c in case.get("controls", [])],
        case.get("control_strength", 1.0),
    )
    out.astype("<f4").tofile(os.path.join(case_dir, "expected.bin"))
    if net.dump_dir is not None:
        with open(os.path.join(case_dir, "dumped.json"), "w") as f:
            json.dump(net.dumped, f)


if __name__ == "__main__":
    main(sys.argv[1:])
