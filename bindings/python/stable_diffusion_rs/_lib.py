"""Finds libstable-diffusion and binds every function of the C API with its prototype.

Lookup order: $STABLE_DIFFUSION_CPP_LIB (a file, or a folder holding the library), the
package's own folder (a wheel built with STABLE_DIFFUSION_CPP_BUNDLE_LIB carries it there),
the `lib` folder of the Python prefix (a virtual environment the library was installed
into with `scripts/install.sh --prefix $VIRTUAL_ENV`), the repository's `prefix/lib` when
the package is imported from a checkout, then the system's library path.
"""

import ctypes
import ctypes.util
import os
import sys

from . import _abi

ENV_VAR = "STABLE_DIFFUSION_CPP_LIB"
if sys.platform == "darwin":
    _NAMES = ["libstable-diffusion.dylib", "libstable-diffusion.0.dylib"]
elif sys.platform == "win32":
    _NAMES = ["stable-diffusion.dll"]
else:
    _NAMES = ["libstable-diffusion.so", "libstable-diffusion.so.0"]


class LibraryNotFound(OSError):
    pass


class MissingSymbol(AttributeError):
    """The loaded library does not export a function of the API."""


def candidates():
    env = os.environ.get(ENV_VAR)
    if env:
        if os.path.isdir(env):
            yield from (os.path.join(env, n) for n in _NAMES)
        else:
            yield env
        return  # an explicit choice is not second-guessed
    here = os.path.dirname(os.path.abspath(__file__))
    folders = [here, os.path.join(sys.prefix, "lib")]
    if os.path.exists(os.path.join(here, "..", "pyproject.toml")):  # a checkout: bindings/python/
        folders.append(os.path.normpath(os.path.join(here, "..", "..", "..", "prefix", "lib")))
    for folder in folders:
        yield from (os.path.join(folder, n) for n in _NAMES)
    found = ctypes.util.find_library("stable-diffusion")
    if found:
        yield found
    yield from _NAMES  # the dynamic loader's own search (LD_LIBRARY_PATH, ld.so.cache)


def load_library():
    errors = []
    for path in candidates():
        if os.path.isabs(path) and not os.path.exists(path):
            errors.append(f"{path}: no such file")
            continue
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise LibraryNotFound(
        "libstable-diffusion not found; set %s to the library file or its folder. Tried:\n  %s"
        % (ENV_VAR, "\n  ".join(errors))
    )


class Lib:
    """The C functions as attributes (lib.sd_version() ...), bound on first use.

    A function the library lacks raises MissingSymbol when used, naming it, instead of
    failing at import: the rest of the API stays usable.
    """

    def __init__(self, cdll):
        self._cdll = cdll

    def __getattr__(self, name):
        proto = _abi.FUNCTIONS.get(name)
        if proto is None:
            raise AttributeError(f"{name} is not a function of stable-diffusion.h")
        restype, argtypes, signature = proto
        try:
            fn = getattr(self._cdll, name)
        except AttributeError:
            raise MissingSymbol(f"{self._cdll._name} does not export `{signature}`") from None
        fn.restype = restype
        fn.argtypes = argtypes
        setattr(self, name, fn)
        return fn

    def missing(self):
        """Names of the API functions the library does not export."""
        return [n for n in _abi.FUNCTIONS if not hasattr(self._cdll, n)]

    def array(self, name):
        """An exported `const char* name[]`, as a list of str (NULL entries as None)."""
        count = _abi.ARRAYS[name]
        try:
            arr = (ctypes.c_char_p * count).in_dll(self._cdll, name)
        except ValueError:
            raise MissingSymbol(f"{self._cdll._name} does not export `const char* {name}[]`") from None
        return [None if s is None else s.decode() for s in arr]

    @property
    def path(self):
        return self._cdll._name


_LIB = None


def lib():
    """The process-wide library (loaded on first use)."""
    global _LIB
    if _LIB is None:
        _LIB = Lib(load_library())
    return _LIB


_libc = None


def c_free(ptr):
    """free() of the C library the library allocates with (results of *_to_str)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.free.argtypes = [ctypes.c_void_p]
        _libc.free.restype = None
    _libc.free(ptr)
