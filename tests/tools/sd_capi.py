#!/usr/bin/env python3
"""Render one case through a stable-diffusion C library (the reference's
libstable-diffusion.so, or ours) with our Python bindings (bindings/python, which bind the
C API by the ABI description, not by any one build), to compare the two on cases the golden
data does not cover.

  sd_capi.py --lib PATH/libstable-diffusion.so --case CASE.json --out OUT.png [--log]

CASE.json is one case in the golden cases.json format: {"ctx": {...}, "params": {...}} with
sd_ctx_params_t / sd_img_gen_params_t field paths as keys ("sample_params.guidance.txt_cfg"),
"{fx}/" for the fixture cache ($SD_FIXTURE_CACHE, default ~/.cache/sd-rs-fixtures), and
image values (init_image, mask_image, control_image, ref_images) naming PNGs in
tests/fixtures/inputs (or absolute paths). The first image generated is written as an 8-bit
PNG. Needs numpy.
"""
import argparse
import json
import logging
import os
import struct
import sys
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, HERE)
IMAGE_KEYS = {"init_image", "mask_image", "control_image", "ref_images"}


def load_image(file):
    """A PNG as the bindings' Image."""
    import stable_diffusion_rs as sd
    from vae_ref import read_png

    path = file if os.path.isabs(file) else os.path.join(ROOT, "tests", "fixtures", "inputs", file)
    return sd.Image.from_numpy(read_png(path)[0].transpose(1, 2, 0).astype(np.uint8))


def write_png(path, img):
    color = {1: 0, 3: 2, 4: 6}[img.channel]
    row = img.width * img.channel
    raw = b"".join(b"\x00" + img.data[y * row:(y + 1) * row] for y in range(img.height))

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", img.width, img.height, 8, color, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def nested(flat, fx):
    """Dotted keys → nested dicts; fixture paths and images resolved."""
    out = {}
    for key, value in flat.items():
        if isinstance(value, str):
            value = value.replace("{fx}", fx)
        if key in IMAGE_KEYS:
            value = [load_image(v) for v in value] if isinstance(value, list) else load_image(value)
        *parents, leaf = key.split(".")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = value
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--case", required=True, help="JSON file or JSON text")
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    os.environ["STABLE_DIFFUSION_CPP_LIB"] = os.path.abspath(a.lib)
    import stable_diffusion_rs as sd

    if a.log:
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(message)s")
    case = json.load(open(a.case)) if os.path.exists(a.case) else json.loads(a.case)
    fx = os.environ.get("SD_FIXTURE_CACHE", os.path.expanduser("~/.cache/sd-rs-fixtures"))
    ctx_params = {"n_threads": a.threads, **nested(case.get("ctx", {}), fx)}
    with sd.Context(**ctx_params) as ctx:
        images = ctx.generate_image(**nested(case.get("params", {}), fx))
    write_png(a.out, images[0])


if __name__ == "__main__":
    main()
