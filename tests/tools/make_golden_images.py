#!/usr/bin/env python3
"""Renders the pictures of a golden image folder (tests/fixtures/golden/<name>/cases.json,
the format tests/common/parity.rs reads) with a stable-diffusion C library, normally the
reference's exact AVX2 build (bench/build-reference.sh --avx2):

  make_golden_images.py --lib LIB --golden DIR [--only CASE ...] [--repeat 2]

Each case is rendered --repeat times by tests/tools/sd_capi.py in a child process; the runs
must give the same bytes, else nothing is written for that case and the exit status is 1.
Only single-picture cases (batch 1) are rendered; the first picture becomes `<case>_0.png`.
Needs numpy (scripts/fixtures.sh --python prints a python with it).
"""
import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def case_spec(folder, case):
    """The sd_capi.py case of a golden case: its context (the folder's model unless it names
    its own) and fields."""
    ctx = dict(case.get("ctx", {}))
    ctx.setdefault("model_path", "{fx}/" + folder["model"])
    spec = {"ctx": ctx, "params": case.get("params", {})}
    if "adetailer" in case:
        spec["adetailer"] = case["adetailer"]
    return spec


def folder_arguments():
    """The options of a tool that renders a golden folder's cases with a library."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--golden", required=True)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--threads", type=int, default=2)
    return ap


def render(lib, folder, case, out, threads):
    """Renders golden case `case` of `folder` with the library `lib` into the PNG `out` by
    sd_capi.py in a child process; whether it worked (a failure is reported)."""
    spec = json.dumps(case_spec(folder, case))
    cmd = [sys.executable, os.path.join(HERE, "sd_capi.py"), "--lib", lib, "--case", spec, "--out", out, "--threads", str(threads)]
    if subprocess.run(cmd).returncode != 0 or not os.path.exists(out):
        print(f"{case['name']}: render failed", file=sys.stderr)
        return False
    return True


def main():
    ap = folder_arguments()
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    folder = json.load(open(os.path.join(a.golden, "cases.json")))
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for case in folder["cases"]:
            if a.only and case["name"] not in a.only:
                continue
            runs = []
            for r in range(a.repeat):
                out = os.path.join(tmp, f"{case['name']}_{r}.png")
                if not render(a.lib, folder, case, out, a.threads):
                    break
                runs.append(out)
            if len(runs) != a.repeat or not all(filecmp.cmp(runs[0], r, shallow=False) for r in runs[1:]):
                print(f"{case['name']}: not written (failed or not reproducible)", file=sys.stderr)
                failed = True
                continue
            shutil.copyfile(runs[0], os.path.join(a.golden, case["images"][0]))
            print(f"{case['name']}: written")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
