"""The ctypes declarations match the C ABI manifest; the library exports all of it."""
import ctypes

import pytest

from stable_diffusion_rs import _abi


def test_every_struct_has_the_manifest_size_and_offsets(manifest):
    for name, s in manifest["structs"].items():
        cls = getattr(_abi, name)
        assert [f[0] for f in cls._fields_] == [f["name"] for f in s["fields"]], name
        assert ctypes.sizeof(cls) == s["size"], name
        assert ctypes.alignment(cls) == s["align"], name
        for f in s["fields"]:
            field = getattr(cls, f["name"])
            assert field.offset == f["offset"], f"{name}.{f['name']}"
            assert field.size == f["size"], f"{name}.{f['name']}"


def test_every_enum_constant_has_its_value(manifest):
    for cname, e in manifest["enums"].items():
        enum = _abi.ENUMS[cname]
        assert [m.value for m in enum] == [c["value"] for c in e["constants"]], cname
        for c in e["constants"]:
            assert _abi.CONSTANTS[c["name"]] == c["value"]
        # signed underlying type only where a constant is negative
        signed = any(c["value"] < 0 for c in e["constants"])
        assert (e["underlying"] == "int") == signed, cname


def test_every_function_and_callback_is_declared(manifest):
    assert set(_abi.FUNCTIONS) == set(manifest["functions"])
    for name, f in manifest["functions"].items():
        restype, argtypes, signature = _abi.FUNCTIONS[name]
        assert len(argtypes) == len(f["params"]), name
        assert (restype is None) == (f["return"] == "void"), name
        assert signature == f["signature"]
    for cb in manifest["callbacks"]:
        assert hasattr(_abi, cb)
    assert set(_abi.ARRAYS) == set(manifest["variables"])


def test_library_exports_every_function(sd):
    missing = sd.raw().missing()
    assert not missing, f"{sd.raw().path} lacks {len(missing)} functions: {', '.join(missing)}"


def test_missing_symbol_is_reported_by_name(sd):
    with pytest.raises(AttributeError):
        sd.raw().no_such_function
