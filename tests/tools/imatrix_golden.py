#!/usr/bin/env python3
"""The imatrix-quant golden set: an importance matrix collected by a stable-diffusion C library
while generating, and the bytes of model conversions quantized with it.

  imatrix_golden.py collect --lib LIB --out FILE.dat
      Z-Image (fixture cache: z_image + qwen3_tiny + zimage_vae), imatrix collection on, one
      64x64 picture; the entries of the diffusion model are kept (the file stays small)
  imatrix_golden.py convert --lib LIB --imatrix FILE.dat --out cases.json [--types q4_0 ...]
      converts z_image.safetensors (as the diffusion model of convert_with_components) to each
      type with the imatrix loaded, and records every tensor's name, type, shape and sha256

  imatrix_golden.py digest --out FILE.gguf
      prints the JSON list of FILE.gguf's tensors (name, type, shape, sha256); plain python3

tests/imatrix_quant.rs converts the same way with our library and compares the digests.
"""
import argparse
import hashlib
import json
import os
import struct
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
FX = os.environ.get("SD_FIXTURE_CACHE", os.path.expanduser("~/.cache/sd-rs-fixtures"))
TYPES = ["q4_0", "q5_1", "q4_K", "q3_K", "q6_K", "iq4_nl"]
# ggml type id -> (bytes per block, values per block)
BLOCKS = {0: (4, 1), 1: (2, 1), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32), 10: (84, 256),
          11: (110, 256), 12: (144, 256), 13: (176, 256), 14: (210, 256), 20: (18, 32), 30: (2, 1)}
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
              12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 30: "BF16"}


def read_dat(path):
    b = open(path, "rb").read()
    (n,), at, entries = struct.unpack_from("<i", b, 0), 4, []
    for _ in range(n):
        (ln,) = struct.unpack_from("<i", b, at)
        name = b[at + 4:at + 4 + ln].decode()
        at += 4 + ln
        ncall, nval = struct.unpack_from("<ii", b, at)
        at += 8
        entries.append((name, ncall, b[at:at + 4 * nval]))
        at += 4 * nval
    (last,) = struct.unpack_from("<i", b, at)
    return entries, last


def write_dat(path, entries, last):
    out = [struct.pack("<i", len(entries))]
    for name, ncall, values in entries:
        out += [struct.pack("<i", len(name)), name.encode(), struct.pack("<ii", ncall, len(values) // 4), values]
    out.append(struct.pack("<i", last))
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(b"".join(out))
    os.replace(tmp, path)


def gguf_tensors(path):
    """(name, type, shape, sha256 of the data) of every tensor of a GGUF file."""
    b = open(path, "rb").read()
    assert b[:4] == b"GGUF", path
    at = 8
    n_tensors, n_kv = struct.unpack_from("<QQ", b, at)
    at += 16
    alignment = 32

    def string(at):
        (n,) = struct.unpack_from("<Q", b, at)
        return b[at + 8:at + 8 + n].decode(), at + 8 + n

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(t, at):
        if t == 8:
            return string(at)
        if t == 9:
            et, n = struct.unpack_from("<IQ", b, at)
            at += 12
            items = []
            for _ in range(n):
                v, at = value(et, at)
                items.append(v)
            return items, at
        fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}[t]
        return struct.unpack_from("<" + fmt, b, at)[0], at + sizes[t]

    for _ in range(n_kv):
        key, at = string(at)
        (t,) = struct.unpack_from("<I", b, at)
        v, at = value(t, at + 4)
        if key == "general.alignment":
            alignment = v
    infos = []
    for _ in range(n_tensors):
        name, at = string(at)
        (nd,) = struct.unpack_from("<I", b, at)
        shape = list(struct.unpack_from("<%dQ" % nd, b, at + 4))
        at += 4 + 8 * nd
        ty, off = struct.unpack_from("<IQ", b, at)
        at += 12
        infos.append((name, ty, shape, off))
    base = (at + alignment - 1) // alignment * alignment
    out = []
    for name, ty, shape, off in infos:
        nbytes, per = BLOCKS[ty]
        n = 1
        for d in shape:
            n *= d
        data = b[base + off:base + off + n // per * nbytes]
        out.append({"name": name, "type": TYPE_NAMES[ty], "shape": shape, "sha256": hashlib.sha256(data).hexdigest()})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["collect", "convert", "digest"])
    ap.add_argument("--lib")
    ap.add_argument("--out", required=True)
    ap.add_argument("--imatrix")
    ap.add_argument("--types", nargs="*", default=TYPES)
    a = ap.parse_args()
    if a.mode == "digest":
        print(json.dumps(gguf_tensors(a.out)))
        return
    os.environ["STABLE_DIFFUSION_CPP_LIB"] = os.path.abspath(a.lib)
    import stable_diffusion_rs as sd

    if a.mode == "collect":
        ctx = {"diffusion_model_path": f"{FX}/z_image.safetensors", "llm_path": f"{FX}/qwen3_tiny.safetensors",
               "vae_path": f"{FX}/zimage_vae.safetensors", "n_threads": 2}
        sd.enable_imatrix_collection()
        with sd.Context(**ctx) as c:
            c.generate_image(prompt="a lovely cat", width=64, height=64, seed=42, sample_params={"sample_steps": 2})
        sd.disable_imatrix_collection()
        with tempfile.TemporaryDirectory() as tmp:
            whole = os.path.join(tmp, "all.dat")
            sd.save_imatrix(whole)
            entries, last = read_dat(whole)
        kept = [e for e in entries if e[0].startswith("model.diffusion_model.")]
        write_dat(a.out, kept, last)
        print(f"{len(kept)} of {len(entries)} entries kept")
        return
    sd.load_imatrix(a.imatrix)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.types:
            out = os.path.join(tmp, f"{name}.gguf")
            ty = getattr(sd.SDType, name.upper())
            # Every path given (the reference builds strings from them: NULL aborts it).
            sd.convert_with_components(out, model_path="", clip_l_path="", clip_g_path="", t5xxl_path="",
                                       diffusion_model_path=f"{FX}/z_image.safetensors", vae_path="",
                                       output_type=ty, tensor_type_rules="", n_threads=2)
            cases.append({"type": name, "tensors": gguf_tensors(out)})
    doc = {"source": "z_image.safetensors (diffusion_model_path of convert_with_components)",
           "imatrix": os.path.basename(a.imatrix), "conversions": cases}
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
