"""*_name, str_to_* and the exported name arrays agree with the reference."""
import pytest

from stable_diffusion_rs import _abi


def constant_value(manifest, fn, key):
    enum = manifest["functions"][fn]["params"][0]["type"][len("enum "):]
    if key.startswith("<out of range"):
        return int(key.split()[-1].rstrip(">"))
    return {c["name"]: c["value"] for c in manifest["enums"][enum]["constants"]}[key]


def test_names(sd, manifest, defaults):
    errors = []
    for fn, table in defaults["names"].items():
        for key, want in table.items():
            got = getattr(sd.raw(), fn)(constant_value(manifest, fn, key))
            if got is None or got.decode() != want:
                errors.append(f"{fn}({key}) = {got!r}, want {want!r}")
    assert not errors, "\n".join(errors)


def test_parse(sd, defaults):
    errors = []
    for fn, table in defaults["parse"].items():
        for key, want in table.items():
            text = "" if key == "<empty string>" else "no-such-name" if key.startswith("<unknown") else key
            got = getattr(sd.raw(), fn)(text.encode())
            if got != want:
                errors.append(f"{fn}({text!r}) = {got}, want {want}")
    assert not errors, "\n".join(errors)


def test_pythonic_names_round_trip(sd):
    for enum in (sd.SampleMethod, sd.Scheduler, sd.RngType, sd.Prediction, sd.Preview, sd.LoraApplyMode,
                 sd.HiresUpscaler):
        for member in enum:
            if member.name == "COUNT":
                assert sd.name_of(member) == "NONE"
                continue
            assert sd.parse(enum, sd.name_of(member)) is member
    assert sd.name_of(sd.SDType.Q8_0) == "q8_0"
    assert sd.parse(sd.SDType, "nope") == sd.SDType.COUNT


@pytest.mark.parametrize("name", ["sample_method_to_str", "scheduler_to_str"])
def test_exported_arrays(sd, defaults, name):
    assert sd.raw().array(name) == defaults[name]
    assert len(defaults[name]) == _abi.ARRAYS[name]
