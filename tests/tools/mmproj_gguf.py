#!/usr/bin/env python3
"""Rewrites a Qwen2.5-VL vision tower file (the tower's HF names, f16 safetensors, e.g. the
synthetic qwen25vl_vision_tiny.safetensors) as a llama.cpp mmproj-style GGUF: clip names
(v.patch_embd.weight[.1], v.blk.N.attn_q/k/v/out, ln1/ln2, ffn_gate/up/down, v.post_ln,
mm.0/mm.2) and the fused qkv split into separate q/k/v, the layout the reference calls
"llama.cpp style". Same values, so both files must give the same pictures.

  mmproj_gguf.py IN.safetensors OUT.gguf
"""
import json
import os
import struct
import sys

import numpy as np


def read_safetensors(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header, base, out = json.loads(raw[8:8 + n]), 8 + n, {}
    for name, v in header.items():
        if name != "__metadata__":
            assert v["dtype"] == "F16", (name, v["dtype"])
            a, b = v["data_offsets"]
            out[name] = np.frombuffer(raw[base + a:base + b], dtype=np.float16).reshape(v["shape"])
    return out


def mmproj(t):
    out = {"v.patch_embd.weight": t["patch_embed.proj.0.weight"], "v.patch_embd.weight.1": t["patch_embed.proj.1.weight"]}
    i = 0
    while f"blocks.{i}.norm1.weight" in t:
        p, q = f"blocks.{i}.", f"v.blk.{i}."
        w, b = t[p + "attn.qkv.weight"], t[p + "attn.qkv.bias"]
        h = w.shape[1]
        for j, k in enumerate("qkv"):
            out[q + f"attn_{k}.weight"], out[q + f"attn_{k}.bias"] = w[j * h:(j + 1) * h], b[j * h:(j + 1) * h]
        for src, dst in (("attn.proj", "attn_out"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")):
            out[q + dst + ".weight"], out[q + dst + ".bias"] = t[p + src + ".weight"], t[p + src + ".bias"]
        out[q + "ln1.weight"], out[q + "ln2.weight"] = t[p + "norm1.weight"], t[p + "norm2.weight"]
        i += 1
    out["v.post_ln.weight"] = t["merger.ln_q.weight"]
    for j in (0, 2):
        out[f"mm.{j}.weight"], out[f"mm.{j}.bias"] = t[f"merger.mlp.{j}.weight"], t[f"merger.mlp.{j}.bias"]
    assert len(out) == len(t) + 4 * i, "unexpected tensors in the tower file"
    return out


def write_gguf(path, tensors, align=32):
    """GGUF v3: matrices f16, vectors f32 (as llama.cpp writes norms and biases)."""
    def s(x):
        b = x.encode()
        return struct.pack("<Q", len(b)) + b
    infos, data = b"", b""
    for name, x in tensors.items():
        x = np.ascontiguousarray(x, dtype=np.float16 if x.ndim > 1 else np.float32)
        ty = 1 if x.ndim > 1 else 0
        infos += s(name) + struct.pack("<I", x.ndim) + b"".join(struct.pack("<Q", d) for d in x.shape[::-1])
        infos += struct.pack("<IQ", ty, len(data))
        data += x.tobytes()
        data += b"\0" * ((-len(data)) % align)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 1) + s("general.architecture") + struct.pack("<I", 8) + s("clip") + infos
    head += b"\0" * ((-len(head)) % align)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(head + data)
    os.replace(tmp, path)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    write_gguf(sys.argv[2], mmproj(read_safetensors(sys.argv[1])))
