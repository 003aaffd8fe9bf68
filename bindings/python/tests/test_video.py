"""Video generation through the Python layer: every sd_vid_gen_params_t field Wan uses set
from keywords (no model needed), Audio conversions, the failure path, and, with the Wan
fixtures and SD_PARITY set, golden case wan/wan_cfg1_9frames rendered through
Context.generate_video.
"""

import array
import ctypes
import os

import pytest

from conftest import ROOT
from test_generate import assert_matches_golden, fixture_cache


def frame(seed, w=8, h=6):
    return __import__("stable_diffusion_rs").Image(w, h, 3, bytes((seed + i * 7) % 256 for i in range(w * h * 3)))


def test_video_params_defaults_are_the_librarys(sd):
    p = sd.vid_gen_params()
    assert (p.width, p.height, p.video_frames, p.fps, p.seed) == (512, 512, 6, 16, -1)
    assert p.high_noise_sample_params.sample_steps == -1
    assert p.sample_params.sample_steps == 20
    assert abs(p.moe_boundary - 0.875) < 1e-7 and p.vace_strength == 1.0 and abs(p.strength - 0.75) < 1e-7
    assert not p.init_image.data and not p.end_image.data and not p.control_frames and p.control_frames_size == 0


def test_every_wan_field_reaches_the_struct(sd):
    lora = "/loras/wan_lightx2v.safetensors"
    audio = sd.Audio(8000, 2, [0.0, 0.5, -0.5, 1.0])
    p = sd.vid_gen_params(
        prompt="a lovely cat",
        negative_prompt="blurry",
        clip_skip=2,
        init_image=frame(1),
        end_image=frame(2),
        ref_images=[frame(3)],
        control_frames=[frame(10), frame(11), frame(12)],
        ref_videos=[{"frames": [frame(20), frame(21)], "fps": 24, "audio": audio}],
        ref_audios=[audio],
        width=832,
        height=480,
        seed=7,
        video_frames=33,
        fps=24,
        strength=0.6,
        moe_boundary=0.9,
        vace_strength=0.7,
        loras=[{"path": lora, "multiplier": 0.8}, {"path": lora, "multiplier": 1.0, "is_high_noise": True}],
        sample_params={"sample_steps": 4, "sample_method": "euler", "scheduler": "simple", "flow_shift": 5.0,
                       "guidance": {"txt_cfg": 1.0, "slg": {"layers": [9, 10], "scale": 2.5}},
                       "custom_sigmas": [1.0, 0.5, 0.0], "extra_sample_args": "gamma=0.5"},
        high_noise_sample_params={"sample_steps": 2, "sample_method": sd.SampleMethod.DPMPP2M,
                                  "guidance": {"txt_cfg": 3.5}, "eta": 0.25},
        cache={"mode": "EASYCACHE", "reuse_threshold": 0.2},
        vae_tiling_params={"enabled": True, "temporal_tiling": True, "tile_size_x": 16, "tile_size_y": 24},
        circular_x=True,
    )
    assert p.prompt == b"a lovely cat" and p.negative_prompt == b"blurry" and p.clip_skip == 2
    assert (p.width, p.height, p.seed, p.video_frames, p.fps) == (832, 480, 7, 33, 24)
    assert abs(p.moe_boundary - 0.9) < 1e-7 and abs(p.vace_strength - 0.7) < 1e-7 and abs(p.strength - 0.6) < 1e-7
    for img, seed in ((p.init_image, 1), (p.end_image, 2), (p.ref_images[0], 3)):
        assert sd.Image.from_c(img).data == frame(seed).data
    assert p.control_frames_size == 3
    assert [sd.Image.from_c(p.control_frames[i]).data for i in range(3)] == [frame(s).data for s in (10, 11, 12)]
    rv = p.ref_videos[0]
    assert (p.ref_videos_count, rv.frame_count, rv.fps) == (1, 2, 24)
    assert sd.Image.from_c(rv.frames[1]).data == frame(21).data
    assert sd.Audio.from_c(rv.audio).samples == audio.samples
    assert p.ref_audios_count == 1 and p.ref_audios[0].sample_count == 2 and p.ref_audios[0].channels == 2
    assert p.lora_count == 2
    assert [(p.loras[i].path, round(p.loras[i].multiplier, 3), p.loras[i].is_high_noise) for i in range(2)] == [
        (lora.encode(), 0.8, False), (lora.encode(), 1.0, True)]
    sp, hp = p.sample_params, p.high_noise_sample_params
    assert (sp.sample_steps, sp.sample_method, sp.scheduler) == (4, sd.SampleMethod.EULER, sd.Scheduler.SIMPLE)
    assert sp.flow_shift == 5.0 and sp.guidance.txt_cfg == 1.0 and sp.guidance.slg.scale == 2.5
    assert [sp.guidance.slg.layers[i] for i in range(sp.guidance.slg.layer_count)] == [9, 10]
    assert [sp.custom_sigmas[i] for i in range(sp.custom_sigmas_count)] == [1.0, 0.5, 0.0]
    assert sp.extra_sample_args == b"gamma=0.5"
    assert (hp.sample_steps, hp.sample_method, hp.guidance.txt_cfg, hp.eta) == (2, sd.SampleMethod.DPMPP2M, 3.5, 0.25)
    assert p.cache.mode == sd.CacheMode.EASYCACHE and abs(p.cache.reuse_threshold - 0.2) < 1e-7
    t = p.vae_tiling_params
    assert (t.enabled, t.temporal_tiling, t.tile_size_x, t.tile_size_y) == (True, True, 16, 24)
    assert p.circular_x and not p.circular_y


def test_bad_fields_are_refused(sd):
    with pytest.raises(TypeError):
        sd.vid_gen_params(frames=3)
    with pytest.raises(ValueError):
        sd.vid_gen_params(sample_params={"sample_method": "no_such_sampler"})
    with pytest.raises(ValueError):
        sd.Audio(8000, 2, [0.0, 0.1, 0.2])


def test_audio_round_trip(sd):
    a = sd.Audio(16000, 1, array.array("f", [0.25, -0.5, 1.0]))
    c, buf = a.to_c()
    assert (c.sample_rate, c.channels, c.sample_count) == (16000, 1, 3)
    back = sd.Audio.from_c(c)
    assert (back.sample_rate, back.channels, list(back.samples)) == (16000, 1, [0.25, -0.5, 1.0])
    assert sd.Audio.from_c(sd.sd_audio_t()).sample_count == 0


def test_failure_raises_with_the_logged_errors(sd):
    # A NULL context: the library answers false and logs why; nothing is left to free.
    with pytest.raises(sd.SDError):
        sd._generate_video(None, sd.vid_gen_params(prompt="x", control_frames=[frame(1)]))


def wan_golden_dir():
    for d in (os.path.join(ROOT, "tests", "fixtures", "golden", "wan"),
              os.path.join(ROOT, "..", "shared", "fixtures", "golden", "wan")):
        if os.path.exists(os.path.join(d, "cases.json")):
            return d
    return None


def test_wan_video_matches_golden_case(sd):
    """Golden case wan/wan_cfg1_9frames: Wan2.1 T2V with UMT5 and the Wan VAE, 64x64, 9
    frames, 3 steps, cfg 1 (about a minute per step on two cores: only with SD_PARITY)."""
    parts = {"diffusion_model_path": "wan21_t2v.safetensors", "t5xxl_path": "umt5_tiny.safetensors",
             "vae_path": "wan_vae.safetensors"}
    paths = {k: os.path.join(fixture_cache(), f) for k, f in parts.items()}
    missing = [p for p in paths.values() if not os.path.exists(p)]
    if missing:
        pytest.skip(f"{missing} missing: scripts/fixtures.sh wan21-t2v umt5-tiny wan-vae writes them")
    if not os.environ.get("SD_PARITY"):
        pytest.skip("a Wan video takes minutes here: set SD_PARITY=1 to run it")
    with sd.Context(n_threads=2, **paths) as ctx:
        assert ctx.supports_video_generation
        video = ctx.generate_video(prompt="a lovely cat", width=64, height=64, seed=42, video_frames=9,
                                   sample_params={"sample_steps": 3, "guidance": {"txt_cfg": 1.0}})
    frames, audio = video
    assert audio is None
    assert len(frames) == 9 and all((f.width, f.height, f.channel) == (64, 64, 3) for f in frames)
    golden = wan_golden_dir()
    if golden is None:
        return
    for i, f in enumerate(frames):
        assert_matches_golden(f, os.path.join(golden, f"wan_cfg1_9frames_{i}.png"))
