#!/usr/bin/env python3
"""Render one case through a stable-diffusion C library (the reference's
libstable-diffusion.so, or ours) with our Python bindings (bindings/python, which bind the
C API by the ABI description, not by any one build), to compare the two on cases the golden
data does not cover.

  sd_capi.py --lib PATH/libstable-diffusion.so --case CASE.json --out OUT.png [--log]
  sd_capi.py --lib PATH/libstable-diffusion.so --case CASE.json --video --out DIR/NAME [--result R.json]

CASE.json is one case in the golden cases.json format: {"ctx": {...}, "params": {...}} with
sd_ctx_params_t / sd_img_gen_params_t (or, with --video, sd_vid_gen_params_t) field paths as
keys ("sample_params.guidance.txt_cfg"), enum values as the C constants' names
("DPMPP2M_SAMPLE_METHOD") or the bindings' names, "{fx}/" for the fixture cache
($SD_FIXTURE_CACHE, default ~/.cache/sd-rs-fixtures), and image values (init_image,
end_image, mask_image, control_image, ref_images, control_frames) naming PNGs in
tests/fixtures/inputs (or absolute paths); `loras` is a list of sd_lora_t dicts. Without
--video the first image generated is written as an 8-bit PNG; with --video every frame is
written as NAME_<i>.png, a sound as NAME.wav (32-bit float, the sd_audio_t samples as
returned), and --result gets {"ok", "frames", "seconds", "errors", "audio"} (seconds:
generate_video alone; audio: {"sample_rate", "channels", "samples"} or null). tests/tools/make_golden_video.py drives this per case. A case with
"adetailer": {"detector", "input", "prompt", "negative_prompt", "extra_ad_args"} runs
adetail_image on that input PNG instead, "params" being the inpainting request. Needs numpy.
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
IMAGE_KEYS = {"init_image", "end_image", "mask_image", "control_image", "ref_images", "control_frames", "ip_adapter_image", "pm_params.id_images"}


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


def enum_fields():
    """Leaf names of the enum-typed fields of every params struct."""
    from stable_diffusion_rs import _abi

    return {f for t in vars(_abi).values() if isinstance(t, type) and hasattr(t, "_enums_") for f in t._enums_}


def with_fx(value, fx):
    """`value` with "{fx}" replaced in every string, lists and dicts included."""
    if isinstance(value, str):
        return value.replace("{fx}", fx)
    if isinstance(value, list):
        return [with_fx(v, fx) for v in value]
    if isinstance(value, dict):
        return {k: with_fx(v, fx) for k, v in value.items()}
    return value


def synth_audio(spec):
    """A test sound from {"sample_rate", "channels", "samples", "period"}: a sawtooth per channel,
    sample k of channel c = ((k * (7 + 3c)) mod period) / period * 1.6 - 0.8 in doubles, then f32
    (tests/common/parity.rs makes the same)."""
    from stable_diffusion_rs import Audio

    rate, ch, n, period = spec["sample_rate"], spec["channels"], spec["samples"], spec["period"]
    data = [((k * (7 + 3 * c)) % period) / period * 1.6 - 0.8 for k in range(n) for c in range(ch)]
    return Audio(rate, ch, np.array(data, dtype=np.float64).astype(np.float32))


def nested(flat, fx):
    """Dotted keys → nested dicts; fixture paths, C enum constant names and images resolved."""
    from stable_diffusion_rs import _abi

    enums = enum_fields()
    out = {}
    for key, value in flat.items():
        value = with_fx(value, fx)
        if key.rsplit(".", 1)[-1] in enums and isinstance(value, str) and value in _abi.CONSTANTS:
            value = _abi.CONSTANTS[value]
        if key in IMAGE_KEYS:
            value = [load_image(v) for v in value] if isinstance(value, list) else load_image(value)
        if key == "ref_videos":
            value = [{**{k: x for k, x in v.items() if k != "audio"}, "frames": [load_image(f) for f in v["frames"]],
                      **({"audio": synth_audio(v["audio"])} if v.get("audio") else {})} for v in value]
        if key == "ref_audios":
            value = [synth_audio(a) for a in value]
        *parents, leaf = key.split(".")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = value
    return out


def write_wav(path, audio):
    """`audio` (the bindings' Audio) as a WAVE_FORMAT_IEEE_FLOAT file, samples as returned."""
    data = audio.samples.tobytes()
    ch, rate = audio.channels, audio.sample_rate
    fmt = struct.pack("<HHIIHH", 3, ch, rate, rate * ch * 4, ch * 4, 32)
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE")
        f.write(b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)


def render_video(case, out, threads, fx):
    """Runs `case` through generate_video; writes the frames as OUT_<i>.png and returns
    {"ok", "frames", "seconds", "errors"} (ok false with the logged errors when the context
    or the generation fails; "ctx_failed" when new_sd_ctx did)."""
    import time

    import stable_diffusion_rs as sd

    errors = []
    sd.set_log_callback(lambda level, text: errors.append(text.rstrip("\n")) if level == sd.LogLevel.ERROR else None)
    ctx_params = {"n_threads": threads, **nested(case.get("ctx", {}), fx)}
    try:
        ctx = sd.Context(**ctx_params)
    except sd.SDError as e:
        return {"ok": False, "frames": 0, "ctx_failed": "\n".join(e.messages) or str(e), "errors": errors}
    with ctx:
        params = nested(case.get("params", {}), fx)
        t0 = time.monotonic()
        try:
            frames, audio = ctx.generate_video(**params)
        except sd.SDError:
            return {"ok": False, "frames": 0, "seconds": round(time.monotonic() - t0, 1), "errors": errors}
        seconds = round(time.monotonic() - t0, 1)
    for i, frame in enumerate(frames):
        write_png(f"{out}_{i}.png", frame)
    sound = None
    if audio is not None:
        write_wav(f"{out}.wav", audio)
        sound = {"sample_rate": audio.sample_rate, "channels": audio.channels, "samples": audio.sample_count}
    return {"ok": True, "frames": len(frames), "seconds": seconds, "errors": errors, "audio": sound}


def adetail(sd, ctx, ad, inpaint, threads, fx):
    """adetail_image through the bindings' pieces (Adetailer.detail's own keywords would
    collide with the inpainting request's prompt)."""
    import ctypes

    keep = []
    with sd.Adetailer(with_fx(ad["detector"], fx), n_threads=threads) as detailer:
        fields = {k: ad.get(k) for k in ("prompt", "negative_prompt", "extra_ad_args")}
        p_ad = sd.fill(sd.sd_adetailer_params_t(), fields, keep)
        p = sd.img_gen_params(**inpaint)
        img, _buf = load_image(ad["input"]).to_c()
        return sd._call_images("adetail_image", sd.raw().adetail_image, detailer.ptr, ctx.ptr, img,
                               ctypes.byref(p_ad), ctypes.byref(p))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--case", required=True, help="JSON file or JSON text")
    ap.add_argument("--out", required=True, help="the PNG; with --video the frames' path prefix")
    ap.add_argument("--video", action="store_true", help="generate_video instead of generate_image")
    ap.add_argument("--result", help="with --video: where the JSON result goes (default: stdout)")
    ap.add_argument("--log", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    os.environ["STABLE_DIFFUSION_CPP_LIB"] = os.path.abspath(a.lib)
    import stable_diffusion_rs as sd

    if a.log:
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(message)s")
    case = json.load(open(a.case)) if os.path.exists(a.case) else json.loads(a.case)
    fx = os.environ.get("SD_FIXTURE_CACHE", os.path.expanduser("~/.cache/sd-rs-fixtures"))
    if a.video:
        result = json.dumps(render_video(case, a.out, a.threads, fx))
        if a.result:
            tmp = a.result + ".tmp"
            with open(tmp, "w") as f:
                f.write(result)
            os.replace(tmp, a.result)
        else:
            print(result)
        return
    ctx_params = {"n_threads": a.threads, **nested(case.get("ctx", {}), fx)}
    with sd.Context(**ctx_params) as ctx:
        ad = case.get("adetailer")
        if ad:
            images = adetail(sd, ctx, ad, nested(case.get("params", {}), fx), a.threads, fx)
        else:
            images = ctx.generate_image(**nested(case.get("params", {}), fx))
    write_png(a.out, images[0])


if __name__ == "__main__":
    main()
