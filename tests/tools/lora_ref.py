#!/usr/bin/env python3
"""numpy reference for the LoRA update math of src/models/adapter/lora (delta.rs).

Writes tests/fixtures/lora/delta_reference.json: small random factor tensors per format and
the weight update each gives, in torch layout, flattened row-major (which is ggml's
contiguous order). Values are rounded to f16 so the Rust test can store them either way.

Formats (scale = multiplier * (scale tensor | alpha / rank | 1), see mod.rs):
  lora / locon   up @ down, reshaped to the weight
  tucker         the reference's (stable-diffusion.cpp 97d29908) rebuild of a LoCon/LoHa
                 Tucker core: T[i, o, kh, kw] = sum D[ro, i] mid[ro, ri, kh, kw] U[o, ri],
                 laid out [in, out, kh, kw] and reinterpreted as the weight's [out, in, kh, kw].
                 This is not LyCORIS' rebuild (mid's first axis with up, result [out, in]):
                 merged (`immediately`) Tucker updates follow the reference; the run-time
                 path convolves down, mid, up and gives LyCORIS' result, which the
                 "runtime_conv" case checks (input x, output conv2d(x, lycoris update)).
  diff           the tensor itself
  loha           (w1a @ w1b) * (w2a @ w2b); with Tucker cores w?a is stored [r, out]
  lokr           kron(w1, w2), w = a @ b when factored; scale 1 unless a factor is factored
  pieces         updates of pieces stacked along the rows, missing rows zero

Usage: lora_ref.py OUT.json
"""
import json
import os
import sys

import numpy as np

rng = np.random.default_rng(20261201)


def t(*shape):
    return rng.uniform(-1, 1, size=shape).astype(np.float16).astype(np.float64)


def flat(a):
    return [float(v) for v in np.asarray(a, dtype=np.float64).reshape(-1)]


def tensors(**kw):
    return {k: {"shape": list(v.shape), "data": flat(v)} for k, v in kw.items()}


def tucker_ref(down, mid, up):
    """The reference's rebuild: [in, out, kh, kw], flattened as the weight."""
    r = down.shape[0]
    d = down.reshape(r, -1)
    u = up.reshape(up.shape[0], -1)
    return np.einsum("ai,abhw,ob->iohw", d, mid, u)


def tucker_lycoris(down, mid, up):
    r = down.shape[0]
    d = down.reshape(r, -1)
    u = up.reshape(up.shape[0], -1)
    return np.einsum("abhw,bi,oa->oihw", mid, d, u)


def conv2d(x, w, stride=1, pad=1):
    """x [C, H, W], w [O, C, kh, kw] -> [O, H', W'] (torch conv2d, no bias)."""
    c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (pad, pad), (pad, pad)))
    oh = (h + 2 * pad - kh) // stride + 1
    ow = (wd + 2 * pad - kw) // stride + 1
    y = np.zeros((o, oh, ow))
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, i * stride:i * stride + kh, j * stride:j * stride + kw]
            y[:, i, j] = np.einsum("chw,ochw->o", patch, w)
    return y


cases = []


def case(name, weight, parts, expected, multiplier=1.0, alpha=None, scale=None, **extra):
    c = {"name": name, "weight": list(weight), "multiplier": multiplier, "pieces": parts,
         "expected": flat(expected)}
    if alpha is not None:
        c["pieces"][0]["alpha"] = alpha
    if scale is not None:
        c["pieces"][0]["scale"] = scale
    c.update(extra)
    cases.append(c)


# LoRA on a linear: alpha / rank, negative multiplier.
down, up = t(3, 8), t(6, 3)
case("lora_linear_alpha", (6, 8), [{"tensors": tensors(lora_down=down, lora_up=up)}], -0.7 * (1.5 / 3) * (up @ down),
     multiplier=-0.7, alpha=1.5)
# A scale tensor wins over alpha.
case("lora_linear_scale", (6, 8), [{"tensors": tensors(lora_down=down, lora_up=up)}], 0.25 * (up @ down), alpha=9.0, scale=0.25)
# No alpha: scale 1. Rank 1 (down [1, in]) works too.
d1, u1 = t(1, 8), t(6, 1)
case("lora_rank1", (6, 8), [{"tensors": tensors(lora_down=d1, lora_up=u1)}], 2.0 * (u1 @ d1), multiplier=2.0)
# LoCon on a 3x3 convolution.
down, up = t(3, 4, 3, 3), t(5, 3, 1, 1)
case("locon_conv", (5, 4, 3, 3), [{"tensors": tensors(lora_down=down, lora_up=up)}],
     (up.reshape(5, 3) @ down.reshape(3, -1)).reshape(5, 4, 3, 3) * (2.0 / 3), alpha=2.0)
# LoCon with a Tucker core, in != out.
down, mid, up = t(3, 4, 1, 1), t(3, 3, 3, 3), t(5, 3, 1, 1)
case("locon_tucker", (5, 4, 3, 3), [{"tensors": tensors(lora_down=down, lora_mid=mid, lora_up=up)}],
     tucker_ref(down, mid, up).reshape(5, 4, 3, 3) * (1.0 / 3), alpha=1.0)
# Full difference.
diff = t(6, 8)
case("diff", (6, 8), [{"tensors": tensors(diff=diff)}], 0.5 * diff, multiplier=0.5)
# LoHa.
w1a, w1b, w2a, w2b = t(6, 2), t(2, 8), t(6, 2), t(2, 8)
case("loha_linear", (6, 8), [{"tensors": tensors(hada_w1_a=w1a, hada_w1_b=w1b, hada_w2_a=w2a, hada_w2_b=w2b)}],
     (w1a @ w1b) * (w2a @ w2b) * (1.0 / 2), alpha=1.0)
# LoHa with Tucker cores on a 3x3 convolution (w?a stored [r, out]).
w1a, w1b, t1, w2a, w2b, t2 = t(2, 5), t(2, 4), t(2, 2, 3, 3), t(2, 5), t(2, 4), t(2, 2, 3, 3)
h1 = tucker_ref(w1b.reshape(2, 4, 1, 1), t1, w1a.T.reshape(5, 2, 1, 1)).reshape(-1)
h2 = tucker_ref(w2b.reshape(2, 4, 1, 1), t2, w2a.T.reshape(5, 2, 1, 1)).reshape(-1)
case("loha_tucker", (5, 4, 3, 3),
     [{"tensors": tensors(hada_w1_a=w1a, hada_w1_b=w1b, hada_t1=t1, hada_w2_a=w2a, hada_w2_b=w2b, hada_t2=t2)}],
     (h1 * h2).reshape(5, 4, 3, 3) * (3.0 / 2), alpha=3.0)
# LoKr: both factors whole (alpha ignored: rank 1).
w1, w2 = t(2, 3), t(3, 4)
case("lokr_full", (6, 12), [{"tensors": tensors(lokr_w1=w1, lokr_w2=w2)}], np.kron(w1, w2), alpha=5.0)
# LoKr with a factored w2: alpha / rank of w2_b.
w1, w2a, w2b = t(2, 2), t(3, 2), t(2, 4)
case("lokr_w2_factored", (6, 8), [{"tensors": tensors(lokr_w1=w1, lokr_w2_a=w2a, lokr_w2_b=w2b)}],
     np.kron(w1, w2a @ w2b) * (1.0 / 2) * 0.9, alpha=1.0, multiplier=0.9)
# LoKr with a factored w1.
w1a, w1b, w2 = t(2, 3), t(3, 3), t(3, 4)
case("lokr_w1_factored", (6, 12), [{"tensors": tensors(lokr_w1_a=w1a, lokr_w1_b=w1b, lokr_w2=w2)}],
     np.kron(w1a @ w1b, w2) * (2.0 / 3), alpha=2.0)
# Three pieces (q, k, v of a fused in_proj), each with its own alpha.
ps, ups = [], []
for i in range(3):
    d, u = t(2, 8), t(4, 2)
    ps.append({"tensors": tensors(lora_down=d, lora_up=u), "alpha": float(i + 1)})
    ups.append(u @ d * ((i + 1) / 2))
case("pieces_qkv", (12, 8), ps, np.concatenate(ups, axis=0))
# Two pieces of three: the last rows stay.
case("pieces_partial", (12, 8), ps[:2], np.concatenate(ups[:2] + [np.zeros((4, 8))], axis=0))

# Run time: a Tucker LoCon as a layer convolves down, mid, up (LyCORIS' update).
down, mid, up = t(3, 4, 1, 1), t(3, 3, 3, 3), t(5, 3, 1, 1)
x = t(4, 6, 7)
lyco = tucker_lycoris(down, mid, up) * 0.5
runtime_conv = {"name": "runtime_conv_tucker", "weight": [5, 4, 3, 3], "multiplier": 0.5,
                "pieces": [{"tensors": tensors(lora_down=down, lora_mid=mid, lora_up=up)}],
                "x": {"shape": list(x.shape), "data": flat(x)}, "expected": flat(conv2d(x, lyco))}

out = {"generator": "tests/tools/lora_ref.py", "cases": cases, "runtime_conv": runtime_conv}
path = sys.argv[1]
tmp = path + ".tmp"
with open(tmp, "w") as f:
    json.dump(out, f)
os.replace(tmp, path)
