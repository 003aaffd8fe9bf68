import json
import os

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
ABI_DIR = os.environ.get("SD_ABI_DIR", os.path.join(ROOT, "tests", "abi"))


@pytest.fixture(scope="session")
def manifest():
    with open(os.path.join(ABI_DIR, "stable-diffusion-abi.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def defaults():
    with open(os.path.join(ABI_DIR, "defaults.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def sd():
    """The package with its library loaded (fails, naming what was tried, if it cannot be)."""
    import stable_diffusion_rs

    stable_diffusion_rs.raw()
    return stable_diffusion_rs
