"""Library facts, devices, images, callbacks and failure paths through the bindings."""
import ctypes
import os
import struct

import pytest


def test_version_commit_system_info(sd):
    assert sd.version()
    assert sd.commit()
    assert sd.system_info().startswith("System Info:")
    assert sd.num_physical_cores() >= 1


def test_list_devices_buffers(sd):
    lib = sd.raw()
    need = lib.sd_list_devices(None, 0)
    assert need > 0
    buf = ctypes.create_string_buffer(b"x" * 8, 8)
    assert lib.sd_list_devices(buf, 0) == need and buf.raw == b"x" * 8  # size 0: nothing written
    short = ctypes.create_string_buffer(5)
    assert lib.sd_list_devices(short, 5) == need
    assert len(short.value) == min(4, need)  # truncated, NUL-terminated
    full = ctypes.create_string_buffer(need + 1)
    assert lib.sd_list_devices(full, need + 1) == need
    assert len(full.value) == need and full.value.endswith(b"\n")
    assert full.value.startswith(short.value)
    devices = sd.list_devices()
    assert any(name == "CPU" for name, _ in devices), devices


def test_images_convert(sd):
    img = sd.Image(3, 2, 3, bytes(range(18)))
    c, buf = img.to_c()
    assert (c.width, c.height, c.channel) == (3, 2, 3)
    assert sd.Image.from_c(c).data == img.data
    with pytest.raises(ValueError):
        sd.Image(3, 2, 3, b"short")


def test_free_sd_images_frees_malloced_images(sd):
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    n = 2
    arr = libc.malloc(ctypes.sizeof(sd.sd_image_t) * n)
    images = ctypes.cast(arr, ctypes.POINTER(sd.sd_image_t))
    for i in range(n):
        images[i].width, images[i].height, images[i].channel = 2, 2, 3
        images[i].data = ctypes.cast(libc.malloc(12), ctypes.POINTER(ctypes.c_uint8))
    sd.free_sd_images(images, n)
    sd.free_sd_images(None, 0)


def test_canny(sd):
    w, h = 32, 24
    pixels = bytearray()
    for y in range(h):
        for x in range(w):
            v = 255 if 8 <= x < 24 and 6 <= y < 18 else 0  # a bright rectangle: edges on its border
            pixels += bytes((v, v, v))
    out = sd.preprocess_canny(sd.Image(w, h, 3, pixels), 0.08, 0.08, 0.8, 1.0, False)
    assert (out.width, out.height, out.channel) == (w, h, 3)
    assert set(out.data) <= {0, 255} and 255 in set(out.data)
    assert all(out.data[i] == out.data[i + 1] == out.data[i + 2] for i in range(0, len(out.data), 3))
    inv = sd.preprocess_canny(sd.Image(w, h, 3, pixels), 0.08, 0.08, 0.8, 1.0, True)
    assert bytes(255 - b for b in out.data) == inv.data


def test_log_callback_receives_messages_and_errors_are_raised(sd, tmp_path):
    seen = []
    sd.set_log_callback(lambda level, text: seen.append((level, text)))
    try:
        missing = str(tmp_path / "no-such-model.safetensors")
        with pytest.raises(sd.SDError) as e:
            sd.Context(model_path=missing, n_threads=1)
        assert seen, "the log callback received nothing"
        assert all(isinstance(level, sd.LogLevel) and isinstance(t, str) for level, t in seen)
        assert any(level == sd.LogLevel.ERROR for level, _ in seen)
        assert e.value.messages, "SDError carries the logged errors"
    finally:
        sd.set_log_callback(None)


def test_progress_and_preview_callbacks_register_and_unregister(sd):
    sd.set_progress_callback(lambda step, steps, t: None)
    sd.set_preview_callback(lambda step, frames, noisy: None, sd.Preview.PROJ, 2, True, False)
    sd.set_progress_callback(None)
    sd.set_preview_callback(None)


def test_failures_are_clean(sd, tmp_path):
    lib = sd.raw()
    nowhere = str(tmp_path / "missing.bin")
    with pytest.raises(sd.SDError):
        sd.Upscaler(nowhere, n_threads=1)
    with pytest.raises(sd.SDError):
        sd.Adetailer(nowhere, n_threads=1)
    with pytest.raises(sd.SDError):
        sd.convert(nowhere, str(tmp_path / "out.gguf"), sd.SDType.F16)
    assert not os.path.exists(tmp_path / "out.gguf")
    with pytest.raises(sd.SDError):
        sd.load_imatrix(nowhere)
    # NULL contexts: failure values, no crash
    p = sd.img_gen_params(prompt="x")
    out = ctypes.POINTER(sd.sd_image_t)()
    n = ctypes.c_int(7)
    assert lib.generate_image(None, ctypes.byref(p), ctypes.byref(out), ctypes.byref(n)) is False
    assert not out
    with pytest.raises(sd.SDError):  # the Pythonic layer's path for every image-returning call
        sd._call_images("generate_image", lib.generate_image, None, ctypes.byref(p))
    v = sd.vid_gen_params()
    audio = ctypes.POINTER(sd.sd_audio_t)()
    assert lib.generate_video(None, ctypes.byref(v), ctypes.byref(out), ctypes.byref(n), ctypes.byref(audio)) is False
    assert lib.sd_ctx_supports_image_generation(None) is False
    assert lib.sd_ctx_supports_video_generation(None) is False
    assert lib.sd_ctx_has_control_net(None) is False
    assert lib.sd_ctx_load_control_net(None, nowhere.encode()) is False
    assert lib.sd_ctx_unload_control_net(None) is False
    assert lib.sd_get_default_sample_method(None) == sd.SampleMethod.EULER_A
    assert lib.sd_get_default_scheduler(None, sd.SampleMethod.LCM) == sd.Scheduler.LCM
    assert lib.get_upscale_factor(None) == 1
    img, buf = sd.Image(2, 2, 3, bytes(12)).to_c()
    assert lib.upscale(None, img, 4, ctypes.byref(out), ctypes.byref(n)) is False
    lib.sd_cancel_generation(None, sd.CancelMode.ALL)
    lib.free_sd_ctx(None)
    lib.free_upscaler_ctx(None)
    lib.free_adetailer_ctx(None)
    lib.free_sd_audio(None)


def test_imatrix_round_trip(sd, tmp_path):
    # one entry "t" with ncall 1 and 4 values, then the call count (format of the reference)
    name = b"model.diffusion_model.t.weight"
    data = struct.pack("i", 1) + struct.pack("i", len(name)) + name + struct.pack("ii", 1, 4)
    data += struct.pack("4f", 0.5, 1.0, 2.0, 4.0) + struct.pack("i", 0)
    src, dst = tmp_path / "in.dat", tmp_path / "out.dat"
    src.write_bytes(data)
    sd.enable_imatrix_collection()
    sd.disable_imatrix_collection()
    sd.load_imatrix(str(src))
    sd.save_imatrix(str(dst))
    assert dst.read_bytes() == data
