#!/usr/bin/env python3
"""Renders golden-style cases (tests/fixtures/golden/<folder>/cases.json) through the C API of
any build of libstable-diffusion (the reference stable-diffusion.cpp 97d29908 or ours: the
header is the same) with ctypes, and compares folders of pictures.

    ref_ctypes_layered.py render --lib LIB --cases CASES.json --out DIR [--abi ABI.json] [--only NAME,...]
    ref_ctypes_layered.py compare DIR_A DIR_B

render writes every returned picture as DIR/<case>_<i>.png (RGBA stays RGBA) and DIR/cases.json:
the input cases with "ok" (generate_image's answer) and "images" (the files) filled in, the
layout of tests/fixtures/golden. Struct layouts come from the ABI description
(/work/shared/abi/stable-diffusion-abi.json by default): fields are written at their offsets
after the library's own *_init functions set the defaults. "{fx}/" in paths is the fixture
cache ($SD_FIXTURE_CACHE, default ~/.cache/sd-rs-fixtures); image inputs are PNGs in
tests/fixtures/inputs. Needs numpy only.
"""
import argparse
import ctypes
import json
import os
import struct
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vae_ref import decode_png  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INPUTS = os.path.join(ROOT, "tests", "fixtures", "inputs")
FIXTURES = os.environ.get("SD_FIXTURE_CACHE") or os.path.expanduser("~/.cache/sd-rs-fixtures")


# ---------------------------------------------------------------- PNG (8-bit, non-interlaced)
def read_png(path):
    w, h, ch, rows = decode_png(path)
    return w, h, ch, rows.tobytes()


def write_png(path, w, h, ch, pixels):
    color = {1: 0, 2: 4, 3: 2, 4: 6}[ch]
    rows = b"".join(b"\x00" + pixels[y * w * ch:(y + 1) * w * ch] for y in range(h))

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, color, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")
    tmp = path + ".tmp"
    open(tmp, "wb").write(png)
    os.replace(tmp, path)


# ---------------------------------------------------------------- structs from the ABI description
class Api:
    def __init__(self, lib_path, abi_path):
        self.abi = json.load(open(abi_path))
        self.structs = self.abi["structs"]
        self.enums = {c["name"]: c["value"] for e in self.abi["enums"].values() for c in e["constants"]}
        self.lib = ctypes.CDLL(lib_path)
        self.keep = []  # buffers the pointers written into structs refer to
        L = self.lib
        L.new_sd_ctx.restype = ctypes.c_void_p
        L.new_sd_ctx.argtypes = [ctypes.c_void_p]
        L.free_sd_ctx.argtypes = [ctypes.c_void_p]
        L.generate_image.restype = ctypes.c_bool
        L.generate_image.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int)]
        L.free_sd_images.argtypes = [ctypes.c_void_p, ctypes.c_int]
        L.sd_ctx_params_init.argtypes = [ctypes.c_void_p]
        L.sd_img_gen_params_init.argtypes = [ctypes.c_void_p]
        self.log_cb = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(self._log)
        L.sd_set_log_callback.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        L.sd_set_log_callback(ctypes.cast(self.log_cb, ctypes.c_void_p), None)
        self.log = []

    def _log(self, level, text, _data):
        line = text.decode("utf-8", "replace").rstrip("\n")
        self.log.append(line)
        if os.environ.get("SD_CTYPES_LOG"):
            print(f"[{level}] {line}", file=sys.stderr)

    def new(self, name):
        buf = ctypes.create_string_buffer(self.structs[name]["size"])
        return buf

    def locate(self, struct_name, dotted):
        off, name = 0, struct_name
        for part in dotted.split("."):
            fields = {f["name"]: f for f in self.structs[name]["fields"]}
            if part not in fields:
                raise KeyError(f"{struct_name} has no field {dotted}")
            f = fields[part]
            off += f["offset"]
            name = f["canonical"].replace("struct ", "")
        return off, name

    def cstr(self, s):
        b = ctypes.create_string_buffer(s.encode())
        self.keep.append(b)
        return ctypes.addressof(b)

    def image(self, file):
        w, h, ch, px = read_png(os.path.join(INPUTS, file))
        b = ctypes.create_string_buffer(px, len(px))
        self.keep.append(b)
        return struct.pack("<IIIxxxxQ", w, h, ch, ctypes.addressof(b))

    def set(self, buf, struct_name, dotted, value):
        off, ty = self.locate(struct_name, dotted)
        if ty in ("const char *", "char *"):
            struct.pack_into("<Q", buf, off, self.cstr(fixture_path(value)) if value is not None else 0)
        elif ty == "sd_image_t":
            buf[off:off + 24] = self.image(value)
        elif ty == "sd_image_t *":
            arr = b"".join(self.image(v) for v in value)
            a = ctypes.create_string_buffer(arr, len(arr))
            self.keep.append(a)
            struct.pack_into("<Q", buf, off, ctypes.addressof(a))
            count = dotted[:-len("ref_images")] + "ref_images_count" if dotted.endswith("ref_images") else None
            if count:
                self.set(buf, struct_name, count, len(value))
        elif ty == "float":
            struct.pack_into("<f", buf, off, float(value))
        elif ty == "_Bool":
            struct.pack_into("<B", buf, off, 1 if value else 0)
        elif ty in ("long", "long long", "int64_t"):
            struct.pack_into("<q", buf, off, int(value))
        elif ty == "unsigned int":
            struct.pack_into("<I", buf, off, int(value))
        elif ty == "int" or ty.startswith("enum "):
            v = self.enums[value] if isinstance(value, str) else int(value)
            struct.pack_into("<i", buf, off, v)
        else:
            raise TypeError(f"{struct_name}.{dotted}: type {ty} is not handled")

    def images(self, ptr, n):
        out = []
        for i in range(n):
            w, h, ch, data = struct.unpack("<IIIxxxxQ", ctypes.string_at(ptr + 24 * i, 24))
            out.append((w, h, ch, ctypes.string_at(data, w * h * ch) if data else b""))
        return out


def fixture_path(v):
    return v.replace("{fx}", FIXTURES) if isinstance(v, str) else v


def render(args):
    api = Api(args.lib, args.abi)
    doc = json.load(open(args.cases))
    only = set(args.only.split(",")) if args.only else None
    os.makedirs(args.out, exist_ok=True)
    ctx, ctx_key = None, None
    out_cases = []
    for case in doc["cases"]:
        if only and case["name"] not in only:
            continue
        key = json.dumps(case["ctx"], sort_keys=True)
        if key != ctx_key:
            if ctx:
                api.lib.free_sd_ctx(ctx)
            cp = api.new("sd_ctx_params_t")
            api.lib.sd_ctx_params_init(cp)
            for k, v in case["ctx"].items():
                api.set(cp, "sd_ctx_params_t", k, v if v != "" else None)
            ctx, ctx_key = api.lib.new_sd_ctx(cp), key
        result = dict(case)
        images = []
        start = time.time()
        if not ctx:
            result["ok"] = False
            result["note"] = "new_sd_ctx failed"
        else:
            gp = api.new("sd_img_gen_params_t")
            api.lib.sd_img_gen_params_init(gp)
            for k, v in case["params"].items():
                api.set(gp, "sd_img_gen_params_t", k, v)
            out_ptr, n = ctypes.c_void_p(), ctypes.c_int(0)
            ok = api.lib.generate_image(ctx, gp, ctypes.byref(out_ptr), ctypes.byref(n))
            result["ok"] = bool(ok)
            if ok and out_ptr.value:
                for i, (w, h, ch, px) in enumerate(api.images(out_ptr.value, n.value)):
                    name = f"{case['name']}_{i}.png"
                    write_png(os.path.join(args.out, name), w, h, ch, px)
                    images.append(name)
                api.lib.free_sd_images(out_ptr, n)
        result["images"] = images
        print(f"{case['name']}: ok={result['ok']} images={len(images)} ({time.time() - start:.1f}s)", flush=True)
        out_cases.append(result)
        api.keep.clear()
    if ctx:
        api.lib.free_sd_ctx(ctx)
    doc = dict(doc, cases=out_cases)
    json.dump(doc, open(os.path.join(args.out, "cases.json"), "w"), indent=1)


def compare(args):
    a = json.load(open(os.path.join(args.a, "cases.json")))
    b = {c["name"]: c for c in json.load(open(os.path.join(args.b, "cases.json")))["cases"]}
    worst = 0
    for ca in a["cases"]:
        cb = b.get(ca["name"])
        if cb is None:
            print(f"{ca['name']}: missing in {args.b}")
            continue
        if ca["ok"] != cb["ok"] or len(ca["images"]) != len(cb["images"]):
            print(f"{ca['name']}: ok {ca['ok']}/{cb['ok']}, images {len(ca['images'])}/{len(cb['images'])}  MISMATCH")
            worst = max(worst, 999)
            continue
        for fa, fb in zip(ca["images"], cb["images"]):
            wa = read_png(os.path.join(args.a, fa))
            wb = read_png(os.path.join(args.b, fb))
            if wa[:3] != wb[:3]:
                print(f"{fa}: size {wa[:3]} vs {wb[:3]}  MISMATCH")
                worst = max(worst, 999)
                continue
            d = np.abs(np.frombuffer(wa[3], np.uint8).astype(int) - np.frombuffer(wb[3], np.uint8).astype(int))
            worst = max(worst, int(d.max()))
            print(f"{fa}: {wa[0]}x{wa[1]}x{wa[2]} max {d.max()} mean {d.mean():.4f}")
        if not ca["images"]:
            print(f"{ca['name']}: ok {ca['ok']} (no images)")
    print(f"worst max diff {worst}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("--lib", required=True)
    r.add_argument("--cases", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--abi", default="/work/shared/abi/stable-diffusion-abi.json")
    r.add_argument("--only")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    render(args) if args.cmd == "render" else compare(args)


if __name__ == "__main__":
    main()
