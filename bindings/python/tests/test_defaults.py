"""Every *_init function fills in the reference's defaults."""
import ctypes
import math

import pytest

from stable_diffusion_rs import _abi

INITS = {
    "sd_ctx_params_init": _abi.sd_ctx_params_t,
    "sd_img_gen_params_init": _abi.sd_img_gen_params_t,
    "sd_vid_gen_params_init": _abi.sd_vid_gen_params_t,
    "sd_sample_params_init": _abi.sd_sample_params_t,
    "sd_cache_params_init": _abi.sd_cache_params_t,
    "sd_hires_params_init": _abi.sd_hires_params_t,
}


def f32(x):
    return ctypes.c_float(x).value


FILL = 0xA5  # every byte before init: a pointer still holding it was not set
UNSET = int.from_bytes(bytes([FILL]) * ctypes.sizeof(ctypes.c_void_p), "little")


def compare(struct, expected, path, cores, errors):
    types = dict(struct._fields_)
    for name, want in expected.items():
        where = f"{path}.{name}"
        ftype = types[name]
        if isinstance(want, dict):
            compare(getattr(struct, name), want, where, cores, errors)
            continue
        if where == "sd_ctx_params_init.n_threads":
            want = cores  # the reference defaults to the physical core count
        if ftype is ctypes.c_char_p or hasattr(ftype, "contents"):
            # pointers: read the address, so that an unset one is reported, not dereferenced
            addr = ctypes.c_void_p.from_address(ctypes.addressof(struct) + getattr(type(struct), name).offset).value
            if addr == UNSET:
                errors.append(f"{where}: not set by init")
            elif want is None:
                if addr:
                    errors.append(f"{where}: {addr:#x} != NULL")
            elif not addr or ctypes.string_at(addr).decode() != want:
                errors.append(f"{where}: {getattr(struct, name)!r} != {want!r}")
            continue
        got = getattr(struct, name)
        if isinstance(want, float):
            if not (got == f32(want) or (math.isnan(want) and math.isnan(got))):
                errors.append(f"{where}: {got!r} != {want!r}")
        elif got != want:
            errors.append(f"{where}: {got!r} != {want!r}")


@pytest.mark.parametrize("init", list(INITS))
def test_init_defaults(sd, defaults, init):
    p = INITS[init]()
    ctypes.memset(ctypes.byref(p), FILL, ctypes.sizeof(p))  # init must set every field
    getattr(sd.raw(), init)(ctypes.byref(p))
    errors = []
    compare(p, defaults["init"][init], init, sd.num_physical_cores(), errors)
    assert not errors, "\n".join(errors)


def test_pythonic_params_start_from_defaults_and_take_keywords(sd):
    p = sd.img_gen_params(prompt="a cat", width=64, sample_params={"sample_steps": 3, "sample_method": "euler"},
                          loras=[{"path": b"x.safetensors", "multiplier": 0.5}])
    assert p.prompt == b"a cat" and p.width == 64 and p.height == 512
    assert p.sample_params.sample_steps == 3
    assert p.sample_params.sample_method == sd.SampleMethod.EULER
    assert p.lora_count == 1 and p.loras[0].multiplier == 0.5
    with pytest.raises(TypeError):
        sd.img_gen_params(no_such_field=1)
    with pytest.raises(ValueError):
        sd.img_gen_params(sample_params={"scheduler": "no-such-scheduler"})


def test_to_str_renders_and_frees(sd):
    for p in (sd.ctx_params(model_path="m.safetensors"), sd.sample_params(), sd.img_gen_params(prompt="a cat")):
        text = sd.to_str(p)
        assert text, type(p).__name__
    assert "m.safetensors" in sd.to_str(sd.ctx_params(model_path="m.safetensors"))
    assert "a cat" in sd.to_str(sd.img_gen_params(prompt="a cat"))
