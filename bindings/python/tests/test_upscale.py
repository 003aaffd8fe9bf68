"""ESRGAN upscaling through the Python layer: the synthetic ESRGAN x4 model must give the
reference's golden picture for case esrgan/upscale_tiled_32 (tests/fixtures/golden/esrgan/cases.json),
which upscales init_64.png in 32-pixel tiles.

The model comes from the fixture cache ($SD_FIXTURE_CACHE, default ~/.cache/sd-rs-fixtures),
where scripts/test.sh writes it with scripts/fixtures.sh.
"""

import os

import pytest

from conftest import ROOT
from test_generate import fixture_cache, read_png

GOLDEN = os.path.join(ROOT, "tests", "fixtures", "golden", "esrgan")


def test_upscale_matches_golden_case(sd):
    model = os.path.join(fixture_cache(), "esrgan_x4.safetensors")
    if not os.path.exists(model):
        pytest.skip(f"{model} is missing: scripts/fixtures.sh esrgan_x4.safetensors writes it")
    w, h, ch, pixels = read_png(os.path.join(ROOT, "tests", "fixtures", "inputs", "init_64.png"))
    with sd.Upscaler(model, n_threads=2, tile_size=32) as up:
        assert up.factor == 4
        images = up.upscale(sd.Image(w, h, ch, pixels), 4)
    assert len(images) == 1
    img = images[0]
    gw, gh, gch, want = read_png(os.path.join(GOLDEN, "upscale_tiled_32_0.png"))
    assert (img.width, img.height, img.channel) == (gw, gh, gch) == (4 * w, 4 * h, 3)
    diffs = [abs(a - b) for a, b in zip(img.data, want)]
    # The tolerance of tests/fixtures/README.md.
    assert max(diffs) <= 3, f"max |diff| {max(diffs)}"
    assert sum(diffs) / len(diffs) <= 0.25, f"mean |diff| {sum(diffs) / len(diffs)}"


def test_upscaler_errors_name_the_problem(sd):
    with pytest.raises(sd.SDError) as e:
        sd.Upscaler("/no/such/esrgan_x4.pth", n_threads=2)
    assert "/no/such/esrgan_x4.pth" in str(e.value)
