"""Python bindings of libstable-diffusion (the stable-diffusion.cpp C API).

Two layers:
- the raw C API: ``raw()`` returns the library with every function bound with its exact
  prototype (``raw().sd_version()``), and the ``sd_*_t`` ctypes structs and enums below;
- a Pythonic layer: ``Context`` / ``Upscaler`` / ``Adetailer`` context managers, params as
  keyword arguments (nested structs as dicts, lists for arrays), images as ``Image``
  (bytes, with optional PIL / numpy conversion), sound as ``Audio``, videos as ``Video``
  (frames, audio), enums as ``IntEnum``, failures raised as ``SDError`` carrying the error
  messages the library logged.
"""

import array
import ctypes
import itertools
import logging
import threading
from collections import deque, namedtuple


from ._abi import (  # noqa: F401  (re-exported)
    ENUMS,
    CacheMode,
    CancelMode,
    HiresUpscaler,
    LogLevel,
    LoraApplyMode,
    Prediction,
    Preview,
    RngType,
    SampleMethod,
    Scheduler,
    SDType,
    VaeFormat,
    sd_adetailer_params_t,
    sd_audio_t,
    sd_cache_params_t,
    sd_ctx_params_t,
    sd_embedding_t,
    sd_guidance_params_t,
    sd_hires_params_t,
    sd_image_t,
    sd_img_gen_params_t,
    sd_lora_t,
    sd_pm_params_t,
    sd_pulid_params_t,
    sd_ref_video_t,
    sd_sample_params_t,
    sd_slg_params_t,
    sd_tiling_params_t,
    sd_vid_gen_params_t,
    sd_log_cb_t,
    sd_progress_cb_t,
    sd_preview_cb_t,
    sd_graph_eval_callback_t,
)
from ._lib import ENV_VAR, LibraryNotFound, MissingSymbol, c_free

__version__ = "0.1.0"
logger = logging.getLogger("stable_diffusion_rs")


class SDError(RuntimeError):
    """A call failed; ``messages`` holds the errors the library logged meanwhile."""

    def __init__(self, what, messages=()):
        self.messages = list(messages)
        detail = "".join(f"\n  {m}" for m in self.messages)
        super().__init__(f"{what}{detail}")


# ------------------------------------------------------------------------------ library

_lock = threading.Lock()
_state = {"lib": None}
_callbacks = {}  # ctypes callback objects the library holds: kept alive while registered
_errors = deque(maxlen=64)  # (sequence number, text) of recent ERROR messages
_seq = itertools.count(1)
_user_log = [None]


def raw():
    """The library, with the log callback routed to Python on first use."""
    lib = _state["lib"]
    if lib is None:
        with _lock:
            if _state["lib"] is None:
                from ._lib import lib as load

                lib = load()
                cb = sd_log_cb_t(_on_log)
                _callbacks["log"] = cb
                lib.sd_set_log_callback(cb, None)
                _state["lib"] = lib
            lib = _state["lib"]
    return lib


def _on_log(level, text, _data):
    try:
        msg = ctypes.string_at(text).decode("utf-8", "replace") if text else ""
        try:
            lvl = LogLevel(level)
        except ValueError:
            lvl = LogLevel.ERROR
        line = msg.rstrip("\n")
        if lvl == LogLevel.ERROR:
            _errors.append((next(_seq), line))
        logger.log(
            {LogLevel.DEBUG: logging.DEBUG, LogLevel.INFO: logging.INFO, LogLevel.WARN: logging.WARNING}.get(
                lvl, logging.ERROR
            ),
            "%s",
            line,
        )
        user = _user_log[0]
        if user is not None:
            user(lvl, msg)
    except Exception:  # an exception must not cross into C
        logger.exception("log callback failed")


def _mark():
    return _errors[-1][0] if _errors else 0


def _errors_since(mark):
    return [t for s, t in list(_errors) if s > mark]


def set_log_callback(fn):
    """Also send each log message to ``fn(level: LogLevel, text: str)`` (None to stop).

    Messages always reach the ``stable_diffusion_rs`` logger as well.
    """
    raw()
    _user_log[0] = fn


def set_progress_callback(fn):
    """``fn(step, steps, seconds)`` after each sampling step; None removes it."""
    lib = raw()
    if fn is None:
        lib.sd_set_progress_callback(sd_progress_cb_t(), None)
        _callbacks.pop("progress", None)
        return

    def tramp(step, steps, time, _data):
        try:
            fn(step, steps, time)
        except Exception:
            logger.exception("progress callback failed")

    cb = sd_progress_cb_t(tramp)
    lib.sd_set_progress_callback(cb, None)
    _callbacks["progress"] = cb


def set_preview_callback(fn, mode=Preview.PROJ, interval=1, denoised=True, noisy=False):
    """``fn(step, frames: list[Image], is_noisy)`` every ``interval`` steps; None removes it."""
    lib = raw()
    if fn is None:
        lib.sd_set_preview_callback(sd_preview_cb_t(), int(Preview.NONE), 1, False, False, None)
        _callbacks.pop("preview", None)
        return

    def tramp(step, count, frames, is_noisy, _data):
        try:
            fn(step, [Image.from_c(frames[i]) for i in range(max(count, 0))] if frames else [], bool(is_noisy))
        except Exception:
            logger.exception("preview callback failed")

    cb = sd_preview_cb_t(tramp)
    lib.sd_set_preview_callback(cb, int(mode), int(interval), bool(denoised), bool(noisy), None)
    _callbacks["preview"] = cb


# ------------------------------------------------------------------------------ facts

def _text(ptr):
    return None if ptr is None else ptr.decode("utf-8", "replace")


def _enc(s):
    return None if s is None else str(s).encode()


def version():
    return _text(raw().sd_version())


def commit():
    return _text(raw().sd_commit())


def system_info():
    return _text(raw().sd_get_system_info())


def num_physical_cores():
    return raw().sd_get_num_physical_cores()


def list_devices():
    """[(name, description)] of the ggml devices, as sd_list_devices reports them."""
    lib = raw()
    need = lib.sd_list_devices(None, 0)
    buf = ctypes.create_string_buffer(need + 1)
    lib.sd_list_devices(buf, len(buf))
    out = []
    for line in buf.value.decode("utf-8", "replace").splitlines():
        name, _, desc = line.partition("\t")
        out.append((name, desc))
    return out


sample_method_names = lambda: raw().array("sample_method_to_str")  # noqa: E731
scheduler_names = lambda: raw().array("scheduler_to_str")  # noqa: E731

# enum -> (name function, parse function)
_NAMING = {
    SDType: ("sd_type_name", "str_to_sd_type"),
    RngType: ("sd_rng_type_name", "str_to_rng_type"),
    SampleMethod: ("sd_sample_method_name", "str_to_sample_method"),
    Scheduler: ("sd_scheduler_name", "str_to_scheduler"),
    Prediction: ("sd_prediction_name", "str_to_prediction"),
    Preview: ("sd_preview_name", "str_to_preview"),
    LoraApplyMode: ("sd_lora_apply_mode_name", "str_to_lora_apply_mode"),
    HiresUpscaler: ("sd_hires_upscaler_name", "str_to_sd_hires_upscaler"),
}


def name_of(value):
    """The library's name of an enum value (e.g. name_of(SampleMethod.EULER_A) == 'euler_a')."""
    fn = _NAMING[type(value)][0]
    return _text(getattr(raw(), fn)(int(value)))


def parse(enum, text):
    """The enum value the library parses `text` as (``enum.COUNT`` when unknown)."""
    v = getattr(raw(), _NAMING[enum][1])(text.encode())
    try:
        return enum(v)
    except ValueError:
        return v


# ------------------------------------------------------------------------------ images

class Image:
    """An 8-bit image: ``data`` holds height*width*channel bytes, row-major, interleaved."""

    __slots__ = ("width", "height", "channel", "data")

    def __init__(self, width, height, channel, data):
        data = bytes(data)
        if len(data) != width * height * channel:
            raise ValueError(f"{width}x{height}x{channel} image needs {width * height * channel} bytes, got {len(data)}")
        self.width, self.height, self.channel, self.data = width, height, channel, data

    def __repr__(self):
        return f"Image({self.width}x{self.height}x{self.channel})"

    @classmethod
    def from_c(cls, img):
        n = img.width * img.height * img.channel
        if not img.data or n == 0:
            return cls(0, 0, 0, b"")
        return cls(img.width, img.height, img.channel, ctypes.string_at(img.data, n))

    def to_c(self):
        """(sd_image_t, buffer): the buffer must outlive every use of the struct."""
        buf = (ctypes.c_uint8 * max(len(self.data), 1)).from_buffer_copy(self.data or b"\0")
        return sd_image_t(self.width, self.height, self.channel, buf), buf

    @classmethod
    def from_pil(cls, img):
        if img.mode not in ("L", "RGB", "RGBA"):
            img = img.convert("RGB")
        return cls(img.width, img.height, {"L": 1, "RGB": 3, "RGBA": 4}[img.mode], img.tobytes())

    def to_pil(self):
        from PIL import Image as PILImage

        mode = {1: "L", 3: "RGB", 4: "RGBA"}[self.channel]
        return PILImage.frombytes(mode, (self.width, self.height), self.data)

    @classmethod
    def from_numpy(cls, arr):
        import numpy as np

        arr = np.ascontiguousarray(arr, dtype=np.uint8)
        if arr.ndim == 2:
            arr = arr[:, :, None]
        h, w, c = arr.shape
        return cls(w, h, c, arr.tobytes())

    def to_numpy(self):
        import numpy as np

        return np.frombuffer(self.data, dtype=np.uint8).reshape(self.height, self.width, self.channel)


class Audio:
    """Sound: ``samples`` holds sample_count*channels floats in [-1, 1], channel-interleaved."""

    __slots__ = ("sample_rate", "channels", "samples")

    def __init__(self, sample_rate, channels, samples):
        samples = array.array("f", samples)
        if channels <= 0 or len(samples) % channels:
            raise ValueError(f"{len(samples)} samples do not make whole frames of {channels} channels")
        self.sample_rate, self.channels, self.samples = int(sample_rate), int(channels), samples

    def __repr__(self):
        return f"Audio({self.sample_count} samples x {self.channels} channels @ {self.sample_rate} Hz)"

    @property
    def sample_count(self):
        """Samples per channel."""
        return len(self.samples) // self.channels

    @classmethod
    def from_c(cls, a):
        n = a.sample_count * a.channels
        data = ctypes.string_at(a.data, n * 4) if a.data and n else b""
        return cls(a.sample_rate, max(a.channels, 1), array.array("f", data))

    def to_c(self):
        """(sd_audio_t, buffer): the buffer must outlive every use of the struct."""
        buf = (ctypes.c_float * max(len(self.samples), 1)).from_buffer_copy(self.samples.tobytes() or bytes(4))
        return sd_audio_t(self.sample_rate, self.channels, self.sample_count, buf), buf


Video = namedtuple("Video", "frames audio")
Video.__doc__ = """What generate_video returns: ``frames`` (list of Image) and ``audio`` (Audio or None).
Unpacks as ``frames, audio = ctx.generate_video(...)``."""


def _take_images(ptr, count):
    """Copies a library-allocated image array into Images and frees it."""
    try:
        return [Image.from_c(ptr[i]) for i in range(count)] if ptr and count > 0 else []
    finally:
        if ptr:
            raw().free_sd_images(ptr, max(count, 0))


def _call_images(what, fn, *args):
    """Calls fn(*args, &images, &count), returns the images (freed in C) or raises SDError."""
    out = ctypes.POINTER(sd_image_t)()
    n = ctypes.c_int(0)
    mark = _mark()
    ok = fn(*args, ctypes.byref(out), ctypes.byref(n))
    images = _take_images(out, n.value)
    if not ok:
        raise SDError(f"{what} failed", _errors_since(mark))
    return images


def free_sd_images(images, count):
    raw().free_sd_images(images, count)


# ------------------------------------------------------------------------------ params

# array field -> its count field
_COUNTS = {
    "embeddings": "embedding_count",
    "loras": "lora_count",
    "ref_images": "ref_images_count",
    "ref_videos": "ref_videos_count",
    "ref_audios": "ref_audios_count",
    "control_frames": "control_frames_size",
    "custom_sigmas": "custom_sigmas_count",
    "layers": "layer_count",
    "id_images": "id_images_count",
    "frames": "frame_count",
}


def fill(struct, values, keep):
    """Sets fields of a ctypes struct from a dict.

    Nested structs take dicts; enum fields take the IntEnum, its member name or the
    library's name ("euler_a"); strings take str; image fields take Image and audio fields
    Audio; array fields take lists (their count field is set too), e.g. ``loras=[{"path":
    p, "multiplier": 1.0}]``, ``control_frames=[Image, ...]``, ``ref_videos=[{"frames":
    [...], "fps": 24, "audio": Audio}]``. Buffers go to `keep`, which must outlive `struct`.
    """
    types = dict(struct._fields_)
    for name, value in values.items():
        if name not in types:
            raise TypeError(f"{type(struct).__name__} has no field {name!r}")
        ftype = types[name]
        if name in struct._enums_:
            setattr(struct, name, _enum_value(ENUMS[struct._enums_[name]], value))
        elif ftype in (sd_image_t, sd_audio_t):
            value = _c_value(value, keep)
            if isinstance(value, dict):
                fill(getattr(struct, name), value, keep)
            else:
                setattr(struct, name, value)
        elif isinstance(ftype, type) and issubclass(ftype, ctypes.Structure):
            if isinstance(value, dict):
                fill(getattr(struct, name), value, keep)
            else:
                setattr(struct, name, value)
        elif ftype is ctypes.c_char_p:
            setattr(struct, name, None if value is None else value.encode() if isinstance(value, str) else value)
        elif name in _COUNTS and isinstance(value, (list, tuple)):
            arr = _array(ftype._type_, value, keep)
            setattr(struct, name, ctypes.cast(arr, ftype) if arr is not None else None)
            setattr(struct, _COUNTS[name], len(value))
        else:
            setattr(struct, name, value)
    return struct


def _c_value(value, keep):
    """An Image or Audio as its C struct (its buffer kept in `keep`); anything else as is."""
    if isinstance(value, (Image, Audio)):
        value, buf = value.to_c()
        keep.append(buf)
    return value


def _array(ctype, items, keep):
    if not items:
        return None
    arr = (ctype * len(items))()
    for i, item in enumerate(items):
        if issubclass(ctype, ctypes.Structure):
            item = _c_value(item, keep)
            if isinstance(item, dict):
                fill(arr[i], item, keep)
            else:
                arr[i] = item
        else:
            arr[i] = item
    keep.append(arr)
    return arr


def _enum_value(enum, value):
    if isinstance(value, str):
        if value in enum.__members__:
            return int(enum[value])
        if enum in _NAMING:
            parsed = parse(enum, value)
            if int(parsed) != int(enum.COUNT):
                return int(parsed)
        raise ValueError(f"{value!r} is not a {enum.__name__}")
    return int(value)


def _params(ctype, init, values):
    """A params struct set by the library's init function, then by `values`."""
    p = ctype()
    if init:
        getattr(raw(), init)(ctypes.byref(p))
    keep = []
    fill(p, values or {}, keep)
    p._keep = keep
    return p


def ctx_params(**values):
    return _params(sd_ctx_params_t, "sd_ctx_params_init", values)


def img_gen_params(**values):
    return _params(sd_img_gen_params_t, "sd_img_gen_params_init", values)


def vid_gen_params(**values):
    return _params(sd_vid_gen_params_t, "sd_vid_gen_params_init", values)


def sample_params(**values):
    return _params(sd_sample_params_t, "sd_sample_params_init", values)


def cache_params(**values):
    return _params(sd_cache_params_t, "sd_cache_params_init", values)


def hires_params(**values):
    return _params(sd_hires_params_t, "sd_hires_params_init", values)


def _owned_text(ptr):
    if not ptr:
        return None
    try:
        return ctypes.string_at(ptr).decode("utf-8", "replace")
    finally:
        c_free(ptr)


def to_str(params):
    """The library's text rendering of a ctx / sample / img-gen params struct."""
    fn = {
        sd_ctx_params_t: "sd_ctx_params_to_str",
        sd_sample_params_t: "sd_sample_params_to_str",
        sd_img_gen_params_t: "sd_img_gen_params_to_str",
    }[type(params)]
    return _owned_text(getattr(raw(), fn)(ctypes.byref(params)))


# ------------------------------------------------------------------------------ contexts

class _Handle:
    _free = None

    def __init__(self, ptr):
        self._ptr = ptr

    @property
    def ptr(self):
        if not self._ptr:
            raise ValueError(f"{type(self).__name__} is closed")
        return self._ptr

    def close(self):
        ptr, self._ptr = self._ptr, None
        if ptr:
            getattr(raw(), self._free)(ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _create(what, fn, *args):
    mark = _mark()
    ptr = fn(*args)
    if not ptr:
        raise SDError(f"{what} failed", _errors_since(mark))
    return ptr


class Context(_Handle):
    """An sd_ctx_t: ``with Context(model_path="m.safetensors") as ctx: ctx.generate_image(...)``.

    Keyword arguments are fields of sd_ctx_params_t (after sd_ctx_params_init).
    """

    _free = "free_sd_ctx"

    def __init__(self, **params):
        p = ctx_params(**params)
        super().__init__(_create("new_sd_ctx", raw().new_sd_ctx, ctypes.byref(p)))

    @property
    def supports_image_generation(self):
        return raw().sd_ctx_supports_image_generation(self.ptr)

    @property
    def supports_video_generation(self):
        return raw().sd_ctx_supports_video_generation(self.ptr)

    def default_sample_method(self):
        return SampleMethod(raw().sd_get_default_sample_method(self.ptr))

    def default_scheduler(self, sample_method=SampleMethod.COUNT):
        return Scheduler(raw().sd_get_default_scheduler(self.ptr, _enum_value(SampleMethod, sample_method)))

    def load_control_net(self, path):
        mark = _mark()
        if not raw().sd_ctx_load_control_net(self.ptr, path.encode()):
            raise SDError(f"loading control net {path} failed", _errors_since(mark))

    def unload_control_net(self):
        return raw().sd_ctx_unload_control_net(self.ptr)

    @property
    def has_control_net(self):
        return raw().sd_ctx_has_control_net(self.ptr)

    def cancel(self, mode=CancelMode.ALL):
        raw().sd_cancel_generation(self.ptr, int(mode))

    def generate_image(self, **params):
        """Images for sd_img_gen_params_t fields given as keywords (e.g. prompt="a cat")."""
        p = img_gen_params(**params)
        return _call_images("generate_image", raw().generate_image, self.ptr, ctypes.byref(p))

    def generate_video(self, **params):
        """A ``Video`` (frames, audio) for sd_vid_gen_params_t fields given as keywords.

        The fields keep sd_vid_gen_params_init's defaults unless given, e.g. Wan2.1 text to
        video: ``ctx.generate_video(prompt="a cat", width=832, height=480, video_frames=33,
        sample_params={"sample_steps": 30, "guidance": {"txt_cfg": 6.0}})``; image to video:
        ``init_image=Image``, first-last frame: ``end_image=Image`` too; VACE:
        ``control_frames=[Image, ...]``, ``vace_strength``; a Wan2.2 MoE pair:
        ``high_noise_sample_params={...}``, ``moe_boundary``; LoRAs of the high-noise model:
        ``loras=[{"path": p, "multiplier": 1.0, "is_high_noise": True}]``; ``cache``,
        ``vae_tiling_params`` as dicts. ``audio`` is None for models without sound.
        """
        return _generate_video(self.ptr, vid_gen_params(**params))


def _generate_video(ctx_ptr, p):
    """Calls generate_video, copies the frames and the audio and frees them in C."""
    out = ctypes.POINTER(sd_image_t)()
    n = ctypes.c_int(0)
    audio = ctypes.POINTER(sd_audio_t)()
    mark = _mark()
    ok = raw().generate_video(ctx_ptr, ctypes.byref(p), ctypes.byref(out), ctypes.byref(n), ctypes.byref(audio))
    frames = _take_images(out, n.value)
    sound = None
    if audio:
        try:
            sound = Audio.from_c(audio.contents) if audio.contents.data else None
        finally:
            raw().free_sd_audio(audio)
    if not ok:
        raise SDError("generate_video failed", _errors_since(mark))
    return Video(frames, sound)


def _threads(n):
    return n if n > 0 else num_physical_cores()


class Upscaler(_Handle):
    """An upscaler_ctx_t (ESRGAN): ``with Upscaler("x4.safetensors") as up: up.upscale(img, 4)``."""

    _free = "free_upscaler_ctx"

    def __init__(self, path, direct=False, n_threads=-1, tile_size=128, backend=None, params_backend=None):
        super().__init__(_create("new_upscaler_ctx", raw().new_upscaler_ctx, _enc(path), bool(direct),
                                 _threads(n_threads), tile_size, _enc(backend), _enc(params_backend)))

    @property
    def factor(self):
        return raw().get_upscale_factor(self.ptr)

    def upscale(self, image, factor=0):
        img, _buf = image.to_c()
        return _call_images("upscale", raw().upscale, self.ptr, img, factor)


class Adetailer(_Handle):
    """An adetailer_ctx_t (face/hand detector + inpainting through a Context)."""

    _free = "free_adetailer_ctx"

    def __init__(self, detector_path, n_threads=-1, backend=None, params_backend=None):
        super().__init__(_create("new_adetailer_ctx", raw().new_adetailer_ctx, _enc(detector_path),
                                 _threads(n_threads), _enc(backend), _enc(params_backend)))

    def detail(self, ctx, image, prompt=None, negative_prompt=None, extra_ad_args=None, **inpaint):
        keep = []
        ad = fill(sd_adetailer_params_t(), {"prompt": prompt, "negative_prompt": negative_prompt,
                                            "extra_ad_args": extra_ad_args}, keep)
        p = img_gen_params(**inpaint)
        img, _buf = image.to_c()
        return _call_images("adetail_image", raw().adetail_image, self.ptr, ctx.ptr, img, ctypes.byref(ad),
                            ctypes.byref(p))


# ------------------------------------------------------------------------------ tools

def _check(what, ok, mark):
    if not ok:
        raise SDError(f"{what} failed", _errors_since(mark))


def convert(input_path, output_path, output_type=SDType.COUNT, vae_path=None, tensor_type_rules=None,
            convert_name=False):
    """Writes a GGUF of the model (``output_type`` COUNT keeps each tensor's type)."""
    mark = _mark()
    ok = raw().convert(_enc(input_path), _enc(vae_path), _enc(output_path), _enum_value(SDType, output_type),
                       _enc(tensor_type_rules), bool(convert_name))
    _check("convert", ok, mark)


def convert_with_components(output_path, model_path=None, clip_l_path=None, clip_g_path=None, t5xxl_path=None,
                            diffusion_model_path=None, vae_path=None, output_type=SDType.COUNT,
                            tensor_type_rules=None, convert_name=False, n_threads=-1):
    mark = _mark()
    ok = raw().convert_with_components(
        _enc(model_path), _enc(clip_l_path), _enc(clip_g_path), _enc(t5xxl_path), _enc(diffusion_model_path),
        _enc(vae_path), _enc(output_path), _enum_value(SDType, output_type), _enc(tensor_type_rules),
        bool(convert_name), n_threads)
    _check("convert_with_components", ok, mark)


def preprocess_canny(image, high_threshold=0.08, low_threshold=0.08, weak=0.8, strong=1.0, inverse=False):
    """The Canny edge map of `image` (same size and channels), as a new Image."""
    img, buf = image.to_c()
    mark = _mark()
    ok = raw().preprocess_canny(img, high_threshold, low_threshold, weak, strong, bool(inverse))
    _check("preprocess_canny", ok, mark)
    return Image(image.width, image.height, image.channel, bytes(buf)[: len(image.data)])


def load_imatrix(path):
    mark = _mark()
    _check(f"load_imatrix({path})", raw().load_imatrix(_enc(path)), mark)


def save_imatrix(path):
    raw().save_imatrix(_enc(path))


def enable_imatrix_collection():
    raw().enable_imatrix_collection()


def disable_imatrix_collection():
    raw().disable_imatrix_collection()
