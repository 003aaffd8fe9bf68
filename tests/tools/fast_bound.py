#!/usr/bin/env python3
"""Measures the fast path's quality bound (issue 28) on a golden image folder: renders every
case with the reference's fastest build (bench/build-reference.sh SRC OUT --llamafile:
llamafile, -march=native) and records how far its picture is from the folder's golden one (the
reference's default AVX2 build) as `"fast_bound": {"max": M, "mean": m}` in cases.json.
tests/fast_path.rs then holds our fast path to the same distance from our exact path
(every case's max; a folder's mean over its cases, within two standard errors).

  fast_bound.py --lib FASTEST/libstable-diffusion.so --golden tests/fixtures/golden/fast-bound
  fast_bound.py --lib FASTEST/libstable-diffusion.so --golden tests/fixtures/golden/zimage --skip-quantized

Each case is rendered once by tests/tools/sd_capi.py in a child process, with the case's
own context (the same fields as the golden render: only the build differs). Needs numpy
(scripts/fixtures.sh --python prints a python with it).
"""
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_golden_images import folder_arguments, render  # noqa: E402
from vae_ref import read_png  # noqa: E402


def main():
    ap = folder_arguments()
    ap.add_argument("--skip-quantized", action="store_true",
                    help="no bound for cases with a quantized wtype (a transformer's fast path leaves their products exact)")
    a = ap.parse_args()
    path = os.path.join(a.golden, "cases.json")
    folder = json.load(open(path))
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for case in folder["cases"]:
            if a.only and case["name"] not in a.only:
                continue
            wtype = case.get("ctx", {}).get("wtype", "")
            if a.skip_quantized and wtype and not wtype.endswith(("F16", "F32", "BF16")):
                case.pop("fast_bound", None)
                continue
            out = os.path.join(tmp, case["name"] + ".png")
            if not render(a.lib, folder, case, out, a.threads):
                failed = True
                continue
            got = read_png(out)[0].astype(np.float64)
            golden = read_png(os.path.join(a.golden, case["images"][0]))[0].astype(np.float64)
            d = np.abs(got - golden)
            case["fast_bound"] = {"max": float(d.max()), "mean": round(float(d.mean()), 4)}
            print(f"{case['name']}: fastest build vs default build: max {d.max():.0f} mean {d.mean():.4f}")
    with open(path + ".tmp", "w") as f:
        json.dump(folder, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
