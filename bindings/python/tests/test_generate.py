"""Generation through the Python layer: the synthetic SD1 and SDXL checkpoints and the Flux
components must render the reference's golden pictures for cases sd1/sampler_euler,
sdxl/sdxl_euler_v, flux/flux_defaults and zimage/zimage_cfg1 (tests/fixtures/golden/*/cases.json).

The checkpoint comes from the fixture cache ($SD_FIXTURE_CACHE, default
~/.cache/sd-rs-fixtures), where scripts/test.sh writes it with scripts/fixtures.sh.
"""

import os
import struct
import zlib

import pytest

from conftest import ROOT

GOLDEN = os.path.join(ROOT, "tests", "fixtures", "golden")


def fixture_cache():
    return os.environ.get("SD_FIXTURE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sd-rs-fixtures")


def read_png(path):
    """(width, height, channels, bytes) of an 8-bit, non-interlaced PNG (no PIL needed)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
    w, h, depth, color, _, _, interlace = header
    assert depth == 8 and interlace == 0, "8-bit non-interlaced PNGs only"
    ch = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    raw, stride = zlib.decompress(idat), w * ch
    out, prev = bytearray(), bytearray(stride)
    for y in range(h):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - ch] if i >= ch else 0
            b, c = prev[i], prev[i - ch] if i >= ch else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        out += line
        prev = line
    return w, h, ch, bytes(out)


def assert_matches_golden(img, png):
    w, h, ch, want = read_png(os.path.join(GOLDEN, png))
    assert (img.width, img.height, img.channel) == (w, h, ch)
    diffs = [abs(a - b) for a, b in zip(img.data, want)]
    # The tolerance of tests/fixtures/README.md.
    assert max(diffs) <= 3, f"max |diff| {max(diffs)}"
    assert sum(diffs) / len(diffs) <= 0.25, f"mean |diff| {sum(diffs) / len(diffs)}"


def render(sd, model, **ctx_params):
    with sd.Context(model_path=model, prediction="V", n_threads=2, **ctx_params) as ctx:
        return ctx.generate_image(
            prompt="a lovely cat",
            width=64,
            height=64,
            seed=42,
            sample_params={"sample_steps": 4, "sample_method": "EULER"},
        )


def test_generate_matches_golden_case(sd):
    model = os.path.join(fixture_cache(), "sd1.safetensors")
    if not os.path.exists(model):
        pytest.skip(f"{model} is missing: scripts/fixtures.sh sd1 writes it")
    progress = []
    sd.set_progress_callback(lambda step, steps, seconds: progress.append((step, steps)))
    try:
        images = render(sd, model)
    finally:
        sd.set_progress_callback(None)
    assert len(images) == 1
    assert_matches_golden(images[0], os.path.join("sd1", "sampler_euler_0.png"))
    assert [s for s, n in progress if n == 4] == [0, 1, 2, 3, 4], progress


def test_generate_sdxl_matches_golden_case(sd):
    model = os.path.join(fixture_cache(), "sdxl.safetensors")
    if not os.path.exists(model):
        pytest.skip(f"{model} is missing: scripts/fixtures.sh sdxl writes it")
    images = render(sd, model, enable_mmap=True)
    assert len(images) == 1
    assert_matches_golden(images[0], os.path.join("sdxl", "sdxl_euler_v_0.png"))


def test_lora_matches_golden_case_and_comes_off_again(sd):
    """Case sd1-lora/lora_1_0 (kohya LoRA merged in), then lora_none_after on the same
    context: the LoRA removed gives the plain picture without reloading the model."""
    model = os.path.join(fixture_cache(), "sd1.safetensors")
    lora = os.path.join(fixture_cache(), "loras", "lora_sd1.safetensors")
    for path in (model, lora):
        if not os.path.exists(path):
            pytest.skip(f"{path} is missing: scripts/fixtures.sh writes it")
    with sd.Context(model_path=model, prediction="V", n_threads=2) as ctx:
        common = dict(prompt="a lovely cat", width=64, height=64, seed=42, sample_params={"sample_steps": 4, "sample_method": "EULER"})
        images = ctx.generate_image(loras=[{"path": lora, "multiplier": 1.0}], **common)
        assert len(images) == 1
        assert_matches_golden(images[0], os.path.join("sd1-lora", "lora_1_0_0.png"))
        images = ctx.generate_image(**common)
        assert_matches_golden(images[0], os.path.join("sd1-lora", "lora_none_after_0.png"))


COMPONENT_CASES = [
    # (golden case, component files, steps, CFG, how to make the files)
    ("flux/flux_defaults",
     {"diffusion_model_path": "flux.safetensors", "t5xxl_path": "t5xxl_tiny.safetensors", "vae_path": "vae16.safetensors"},
     3, 1.0, "flux t5xxl-tiny vae16"),
    ("zimage/zimage_cfg1",
     {"diffusion_model_path": "z_image.safetensors", "llm_path": "qwen3_tiny.safetensors", "vae_path": "zimage_vae.safetensors"},
     4, 1.0, "z-image qwen3-tiny zimage-vae"),
]


@pytest.mark.parametrize("case,parts,steps,cfg,make", COMPONENT_CASES, ids=[c[0] for c in COMPONENT_CASES])
def test_model_from_components_matches_golden_case(sd, case, parts, steps, cfg, make):
    """A DiT family held as separate files (diffusion model, text encoder, VAE): Flux with T5,
    Z-Image with its Qwen3 LLM."""
    paths = {k: os.path.join(fixture_cache(), f) for k, f in parts.items()}
    for path in paths.values():
        if not os.path.exists(path):
            pytest.skip(f"{path} is missing: scripts/fixtures.sh {make} writes it")
    with sd.Context(n_threads=2, **paths) as ctx:
        images = ctx.generate_image(
            prompt="a lovely cat",
            width=64,
            height=64,
            seed=42,
            sample_params={"sample_steps": steps, "guidance": {"txt_cfg": cfg}},
        )
    assert len(images) == 1
    folder, name = case.split("/")
    assert_matches_golden(images[0], os.path.join(folder, f"{name}_0.png"))
