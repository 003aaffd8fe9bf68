"""Build hook of the package (the metadata is in pyproject.toml).

With STABLE_DIFFUSION_CPP_BUNDLE_LIB set to a folder holding an installed
libstable-diffusion (e.g. `prefix/lib` after scripts/install.sh), the library and the ggml
modules beside it are copied into the package, so that the wheel works without any setting:
the package's own folder is searched first, and the library finds its ggml libraries and
CPU backend modules next to itself ($ORIGIN). Such a wheel is platform-specific.
"""

import os
import re
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

BUNDLE_VAR = "STABLE_DIFFUSION_CPP_BUNDLE_LIB"


def bundle_files(folder):
    """(source path, name in the package) for each shared library in `folder`, one name per
    real file: the one with a single version number (`libggml.so.0`, the name the loader
    asks for), else the plain `.so` / `.dylib` / `.dll` one."""
    by_real = {}
    for name in sorted(os.listdir(folder)):
        if not re.search(r"\.(so(\.\d+)*|dylib|dll)$", name) or not name.startswith(("lib", "stable-diffusion", "ggml")):
            continue
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            by_real.setdefault(os.path.realpath(path), []).append(name)
    chosen = []
    for real, names in by_real.items():
        versioned = [n for n in names if re.search(r"\.so\.\d+$", n)]
        chosen.append((real, (versioned or sorted(names, key=len))[0]))
    return chosen


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "stable_diffusion_rs")
        # A build folder reused from a bundling build must not leak its libraries.
        for name in os.listdir(target):
            if re.search(r"\.(so(\.\d+)*|dylib|dll)$", name):
                os.remove(os.path.join(target, name))
        folder = os.environ.get(BUNDLE_VAR)
        if not folder:
            return
        if not os.path.isdir(folder):
            raise SystemExit(f"{BUNDLE_VAR}={folder}: not a folder")
        files = bundle_files(folder)
        if not any(n.startswith(("libstable-diffusion", "stable-diffusion")) for _, n in files):
            raise SystemExit(f"{BUNDLE_VAR}={folder}: no libstable-diffusion there")
        for src, name in files:
            shutil.copyfile(src, os.path.join(target, name))
            os.chmod(os.path.join(target, name), 0o755)
            print(f"bundled {src} as stable_diffusion_rs/{name}")


class MaybeBinaryDistribution(Distribution):
    """A wheel with a bundled library is tagged for this platform, not `py3-none-any`."""

    def has_ext_modules(self):
        return bool(os.environ.get(BUNDLE_VAR))


setup(cmdclass={"build_py": BuildPyWithLibrary}, distclass=MaybeBinaryDistribution)
