#!/usr/bin/env python3
"""Golden video sets (generate_video) rendered by a stable-diffusion C library, and checks of a
library against them. Same conventions as the shared wan/ set (tests/fixtures/README.md,
"Golden video sets"): cases.json lists each case's `ctx` (sd_ctx_params_t fields) and `params`
(sd_vid_gen_params_t fields after sd_vid_gen_params_init, dotted names, C enum constant names,
input PNGs of tests/fixtures/inputs, "{fx}" = the fixture cache), the frames `<case>_<i>.png` in
order, "frames", "audio": null, "seconds" and an optional "tolerance".

  make_golden_video.py inputs
      writes the input PNGs the sets use into tests/fixtures/inputs (a file already there is kept)
  make_golden_video.py render --lib LIB --set SET --out DIR [--only CASE ...] [--repeat 2]
      renders the cases of SET (see `list`) into DIR (frames + cases.json; cases not rendered
      keep their records). Each run is a child process (tests/tools/sd_capi.py --video); every
      case is rendered --repeat times and all frames must be identical, else nothing of that
      case is written and the exit status is 1. A run killed by a signal is recorded as
      "reference_crashed".
  make_golden_video.py check --lib LIB --golden DIR [--only CASE ...] [--exact] [--ctx KEY=JSON ...]
      renders the cases of DIR/cases.json and compares every frame with its golden PNG
      (the case's tolerance, default max 3 / mean 0.25; --exact: max 0). --ctx overrides
      context fields, e.g. --ctx diffusion_flash_attn=true: how far a perturbation that keeps
      the arithmetic's meaning moves the frames (the calibration of a tolerance)
  make_golden_video.py list
      the sets, their cases and the fixture files they need

--threads (default 1) is n_threads; the pictures do not depend on it. --keep DIR keeps each
run's frames and log there. Needs numpy (scripts/fixtures.sh --python prints a python with it).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
INPUTS = os.path.join(ROOT, "tests", "fixtures", "inputs")
sys.path.insert(0, HERE)

from sd_capi import write_png  # noqa: E402
from vae_ref import decode_png  # noqa: E402

MAX_DIFF, MEAN_DIFF = 3, 0.25
# Sound: max |difference| of the float samples in [-1, 1] (tests/fixtures/README.md).
SOUND_MAX_DIFF = 1e-3

# ------------------------------------------------------------------------------ inputs


def _rgb(w, h, fn):
    """An RGB image whose pixel (x, y) is fn(x, y) (arrays in, 0..255 arrays out)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r, g, b = fn(x / (w - 1), y / (h - 1))
    return np.clip(np.stack([r, g, b], axis=-1), 0, 255).round().astype(np.uint8)


def _end_picture(x, y):
    """Concentric rings in warm colours (unlike init_64's colour grid): a last frame."""
    d = np.hypot(x - 0.35, y - 0.6)
    return 128 + 110 * np.cos(18 * d), 90 + 80 * np.sin(11 * x + 3 * y), 60 + 50 * np.cos(7 * y)


def _start_picture(x, y):
    """A diagonal colour sweep with a dark band: a first frame for non-square sizes."""
    band = np.abs(x - y) < 0.15
    return (40 + 200 * x) * ~band + 20, (220 - 180 * y) * ~band + 20, 120 + 100 * np.sin(9 * x) * ~band


def _control(i, n):
    """Frame i of n of a control video: a white disk moving left to right over a grey
    horizon line, on dark blue (edges and flat areas, like a pose / depth map)."""
    def fn(x, y):
        cx = 0.2 + 0.6 * i / max(n - 1, 1)
        disk = np.hypot((x - cx) * 1.5, y - 0.45) < 0.22
        line = np.abs(y - 0.8) < 0.04
        v = np.where(disk, 255, np.where(line, 150, 30))
        return v, v, np.maximum(v, 90)
    return fn


INPUT_PNGS = {
    "end_64.png": (64, 64, _end_picture),
    "init_96x64.png": (96, 64, _start_picture),
    "end_96x64.png": (96, 64, _end_picture),
    **{f"vace_ctrl_64_{i}.png": (64, 64, _control(i, 5)) for i in range(5)},
    **{f"vace_ctrl_96x64_{i}.png": (96, 64, _control(i, 5)) for i in range(5)},
}


def write_inputs():
    for name, (w, h, fn) in INPUT_PNGS.items():
        path = os.path.join(INPUTS, name)
        if os.path.exists(path):
            continue
        arr = _rgb(w, h, fn)
        tmp = path + ".tmp"
        write_png(tmp, types.SimpleNamespace(width=w, height=h, channel=3, data=arr.tobytes()))
        os.replace(tmp, path)
        print("wrote", path)


# ------------------------------------------------------------------------------ sets

UMT5 = "{fx}/umt5_tiny.safetensors"
VAE = "{fx}/wan_vae.safetensors"
TAEW2_1 = "{fx}/taew2_1.safetensors"
TAEW2_2 = "{fx}/taew2_2.safetensors"


def _ctx(dit, **extra):
    return {"model_path": "", "diffusion_model_path": "{fx}/" + dit, "t5xxl_path": UMT5, "vae_path": VAE, **extra}


def _params(steps=3, frames=5, w=64, h=64, seed=42, cfg=1.0, **extra):
    p = {"prompt": "a lovely cat", "width": w, "height": h, "seed": seed, "video_frames": frames,
         "sample_params.sample_steps": steps, "sample_params.guidance.txt_cfg": cfg}
    p.update(extra)
    return p


def _case(name, ctx, params, **extra):
    return {"name": name, "ctx": ctx, "params": params, **extra}


def _ctrl(n, size="64"):
    return [f"vace_ctrl_{size}_{i}.png" for i in range(n)]


VACE = _ctx("wan21_vace.safetensors")
I2V = _ctx("wan21_i2v.safetensors", clip_vision_path="{fx}/clip_vision_h.safetensors")
FLF2V = _ctx("wan21_flf2v.safetensors", clip_vision_path="{fx}/clip_vision_h.safetensors")
T2V = _ctx("wan21_t2v.safetensors")
MOE = _ctx("wan21_t2v_prefixed.safetensors", high_noise_diffusion_model_path="{fx}/wan21_t2v.safetensors")


FLF_NOTE = ("a 30-layer DiT with img_emb.emb_pos is \"Wan2.1-I2V-1.3B\" to the reference: it passes only the start "
            "image's 257 CLIP tokens (zeros without one), which WAN::MLPProj::forward slices to emb_pos' 514 rows. "
            "Ours must return false or render, never crash")


def _lora(file, multiplier, high_noise=False):
    return {"path": "{fx}/loras/" + file, "multiplier": multiplier, "is_high_noise": high_noise}


HUNYUAN = {"model_path": "", "diffusion_model_path": "{fx}/hunyuan_video.safetensors",
           "llm_path": "{fx}/qwen25vl_tiny.safetensors", "vae_path": "{fx}/hunyuan_vae.safetensors"}
HUNYUAN_BYT5 = {**HUNYUAN, "diffusion_model_path": "{fx}/hunyuan_video_byt5.safetensors",
                "t5xxl_path": "{fx}/byt5_tiny.safetensors"}
LINGBOT = {"model_path": "", "diffusion_model_path": "{fx}/lingbot_video.safetensors",
           "llm_path": "{fx}/qwen3vl_tiny80.safetensors", "vae_path": VAE}
LINGBOT_VISION = {**LINGBOT, "llm_vision_path": "{fx}/qwen3vl_vision_tiny80.safetensors"}
AD = {"model_path": "{fx}/sd1.safetensors", "motion_module_path": "{fx}/animatediff_sd15.safetensors"}
AD_NOTE_64 = ("at 64x64 the lowest UNet level is 1x1: the reference's motion module takes the permuted "
              "[1, 1, C, F] view for contiguous and ggml_add aborts (nb00 == sizeof(src0_t)). Ours renders")

MINIMAX = {"model_path": "", "diffusion_model_path": "{fx}/minimax_h3.safetensors", "llm_path": "{fx}/qwen3vl_51.safetensors",
           "vae_path": "{fx}/minimax_h3_vae.safetensors", "enable_mmap": True}
MINIMAX_SOUND = {**MINIMAX, "audio_vae_path": "{fx}/minimax_h3_audio_vae.safetensors"}
MINIMAX_VISION = {**MINIMAX, "llm_vision_path": "{fx}/qwen3vl_vision_deepstack80.safetensors"}
MINIMAX_VISION_SOUND = {**MINIMAX_SOUND, "llm_vision_path": "{fx}/qwen3vl_vision_deepstack80.safetensors"}
# 11 frames at 12 fps: 22 at 24 fps, so the LLM is shown frames 0 and 12 (source frames 0 and 6) as one pair
MM_VIDEO_11 = _ctrl(5) + _ctrl(5)[::-1] + [_ctrl(5)[2]]

LTX = {"model_path": "", "diffusion_model_path": "{fx}/ltx.safetensors", "llm_path": "{fx}/gemma3_ltx.safetensors",
       "embeddings_connectors_path": "{fx}/ltx_connectors.safetensors", "vae_path": "{fx}/ltx_vae.safetensors",
       "enable_mmap": True}
LTX_SOUND = {**LTX, "audio_vae_path": "{fx}/ltx_audio_vae.safetensors"}
LTX_I2V = {**LTX, "vae_path": "{fx}/ltx_vae_i2v.safetensors"}
LTX_CONNECTORS = {**LTX, "embeddings_connectors_path": "{fx}/ltx_connectors_full.safetensors"}
LTX_VAE_TS = {**LTX, "vae_path": "{fx}/ltx_vae_ts.safetensors"}
LTX_HIRES = {"hires.enabled": True, "hires.upscaler": "SD_HIRES_UPSCALER_MODEL",
             "hires.model_path": "{fx}/ltx_upscaler.safetensors", "hires.denoising_strength": 0.4}

SETS = {
    "animatediff": {
        # SD 1.x + an AnimateDiff motion module (mm_sd_v15_v2 layout): generate_video renders the
        # frames as one batch through generate_image (default sampler euler_a)
        "model": "sd1.safetensors",
        "fixtures": ["sd1.safetensors", "animatediff_sd15.safetensors"],
        "cases": [
            _case("ad_4frames_128x64", AD, _params(steps=2, frames=4, w=128)),
            _case("ad_8frames_cfg5_negative", AD, _params(steps=3, frames=8, w=64, h=128, seed=7, cfg=5.0,
                                                          negative_prompt="blurry, static")),
            _case("ad_16frames_dpmpp2m_karras", AD, _params(steps=3, frames=16, w=128, seed=123,
                                                            **{"sample_params.sample_method": "DPMPP2M_SAMPLE_METHOD",
                                                               "sample_params.scheduler": "KARRAS_SCHEDULER"})),
            _case("ad_img2img_8frames", AD, _params(steps=4, frames=8, w=128, seed=5, strength=0.6,
                                                    init_image="init_96x64.png")),
            _case("ad_40frames_capped_32", AD, _params(steps=1, frames=40, w=128, seed=9),
                  note="more than 32 frames are capped to the positional table's 32 (a warning)"),
            _case("ad_hires_latent_3frames", AD, _params(steps=1, frames=3, h=128, **{"hires.enabled": True, "hires.steps": 1,
                                                                                 "hires.scale": 1.5}),
                  note="the hires fix (latent upscaler) on the batch of frames: 64x128 -> 128x192 (aligned up)"),
            _case("ad_1frame", AD, _params(steps=2, frames=1, w=128, seed=3),
                  note="one frame: a plain picture, the motion modules do not run"),
            _case("ad_64x64", AD, _params(steps=2, frames=4), note=AD_NOTE_64),
        ],
    },
    "wan-vace": {
        "model": "wan21_vace.safetensors",
        "fixtures": ["wan21_vace.safetensors", "umt5_tiny.safetensors", "wan_vae.safetensors"],
        "cases": [
            _case("vace_control", VACE, _params(control_frames=_ctrl(5))),
            _case("vace_ref_image_control", VACE, _params(steps=2, init_image="init_64.png", control_frames=_ctrl(5))),
            _case("vace_strength_0_5", VACE, _params(control_frames=_ctrl(5), vace_strength=0.5)),
            _case("vace_fewer_control_frames_9", VACE, _params(steps=2, frames=9, control_frames=_ctrl(3))),
            _case("vace_96x64_ref_image", VACE, _params(steps=2, w=96, h=64, seed=123, init_image="init_96x64.png",
                                                         control_frames=_ctrl(2, "96x64"))),
            _case("vace_no_control", VACE, _params(steps=2)),
        ],
    },
    "wan-i2v": {
        "model": "wan21_i2v.safetensors",
        "fixtures": ["wan21_i2v.safetensors", "clip_vision_h.safetensors", "umt5_tiny.safetensors",
                     "wan_vae.safetensors"],
        "cases": [
            _case("i2v_init_image", I2V, _params(init_image="init_64.png")),
            _case("i2v_no_init_image", I2V, _params(steps=2)),
            _case("i2v_96x64", I2V, _params(steps=2, w=96, h=64, seed=123, init_image="init_96x64.png")),
            _case("i2v_9frames_resized_init", I2V, _params(steps=2, frames=9, init_image="init_80x48.png")),
            _case("i2v_init_and_end_image", I2V, _params(init_image="init_64.png", end_image="end_64.png")),
            # cfg 3 amplifies rounding: flash attention moves it by max 2, mean 0.28 (the shared
            # wh_cfg3_negative_shift8 measured the same and carries this tolerance)
            _case("i2v_cfg3_negative", I2V, _params(steps=2, cfg=3.0, init_image="init_64.png",
                                                    negative_prompt="blurry, static, low quality"),
                  tolerance={"max": 4, "mean": 0.5}),
        ],
    },
    "wan-flf2v": {
        "model": "wan21_flf2v.safetensors",
        "fixtures": ["wan21_flf2v.safetensors", "clip_vision_h.safetensors", "umt5_tiny.safetensors",
                     "wan_vae.safetensors"],
        # The reference names a 30-layer DiT with img_emb.emb_pos "Wan2.1-I2V-1.3B" (FLF2V needs the
        # 40-layer 14B sizes), gives it the start image's 257 CLIP tokens only, and its MLPProj then
        # slices those 257 tokens to emb_pos' 514: GGML_ASSERT in ggml_ext_slice, whatever the images.
        "cases": [
            _case("flf2v_1_3b_first_last", FLF2V, _params(init_image="init_64.png", end_image="end_64.png"),
                  note=FLF_NOTE),
            _case("flf2v_1_3b_no_images", FLF2V, _params(steps=2), note=FLF_NOTE),
        ],
    },
    "wan-lora": {
        "model": "wan21_t2v.safetensors",
        "fixtures": ["wan21_t2v.safetensors", "umt5_tiny.safetensors", "wan_vae.safetensors",
                     "loras/lora_wan_comfy.safetensors", "loras/lora_wan_kohya.safetensors",
                     "loras/lora_wan_lightx2v.safetensors"],
        "cases": [
            _case("t2v_no_lora", T2V, _params(), note="the baseline: every LoRA case but lora_two_96x64 is this "
                                                      "case with a LoRA"),
            _case("lora_comfy_1_0", T2V, _params(loras=[_lora("lora_wan_comfy.safetensors", 1.0)])),
            _case("lora_comfy_0_5", T2V, _params(loras=[_lora("lora_wan_comfy.safetensors", 0.5)])),
            _case("lora_comfy_at_runtime", _ctx("wan21_t2v.safetensors", lora_apply_mode="LORA_APPLY_AT_RUNTIME"),
                  _params(loras=[_lora("lora_wan_comfy.safetensors", 1.0)])),
            _case("lora_kohya_1_0", T2V, _params(loras=[_lora("lora_wan_kohya.safetensors", 1.0)])),
            _case("lora_lightx2v_0_5", T2V, _params(loras=[_lora("lora_wan_lightx2v.safetensors", 0.5)])),
            _case("lora_two_96x64", T2V, _params(steps=2, w=96, h=64, seed=123,
                                                  loras=[_lora("lora_wan_comfy.safetensors", 0.5),
                                                         _lora("lora_wan_kohya.safetensors", 1.0)])),
        ],
    },
    "taehv": {
        "model": "wan21_t2v.safetensors",
        "fixtures": ["wan21_t2v.safetensors", "wan21_i2v.safetensors", "clip_vision_h.safetensors",
                     "umt5_tiny.safetensors", "wan_vae.safetensors", "taew2_1.safetensors",
                     "wan22_ti2v.safetensors", "taew2_2.safetensors", "taew2_1_wide.safetensors"],
        "cases": [
            _case("taehv_t2v_96x64", {**_ctx("wan21_t2v.safetensors", taesd_path=TAEW2_1), "vae_path": ""},
                  _params(steps=2, frames=9, w=96, h=64, seed=123),
                  note="the TAEHV (taesd_path) decodes; no VAE file"),
            _case("taehv_i2v_init_image", _ctx("wan21_i2v.safetensors", clip_vision_path="{fx}/clip_vision_h.safetensors",
                                               taesd_path=TAEW2_1),
                  _params(steps=2, init_image="init_64.png"),
                  note="the TAEHV encodes the conditioning video and decodes, the VAE file is not used"),
            _case("taehv_preview_only", _ctx("wan21_t2v.safetensors", taesd_path=TAEW2_1, tae_preview_only=True),
                  _params(steps=2), note="tae_preview_only: the VAE decodes, the TAEHV would make the previews"),
            _case("taehv_wide_t2v", {**_ctx("wan21_t2v.safetensors", taesd_path="{fx}/taew2_1_wide.safetensors"), "vae_path": ""},
                  _params(steps=2), note="a TAEHV with the wide decoder (decoder.3.conv.6.weight: grouped convolutions)"),
            _case("taehv22_ti2v_t2v", {**_ctx("wan22_ti2v.safetensors", taesd_path=TAEW2_2), "vae_path": "", "t5xxl_path": ""},
                  _params(steps=2), note="Wan2.2 TI2V 5B with taew2_2 (48 channels, 2x2 patches), no UMT5, no VAE file"),
            _case("taehv22_ti2v_i2v", {**_ctx("wan22_ti2v.safetensors", taesd_path=TAEW2_2), "vae_path": "", "t5xxl_path": ""},
                  _params(steps=2, init_image="init_64.png"),
                  note="TI2V's init image encoded by taew2_2 (its first latent frame kept)"),
        ],
    },
    "hunyuan-video": {
        # HunyuanVideo 1.5: the DiT (hunyuan_video.safetensors: hidden 2048, 1 double block, the
        # token refiner, meanflow's time_r_in), Qwen2.5-VL's text model and the decoder-only
        # HunyuanVideo VAE at 32x32; its defaults: euler, the discrete schedule, flow shift 7, cfg 7
        # with the empty negative prompt
        "model": "hunyuan_video.safetensors",
        "fixtures": ["hunyuan_video.safetensors", "qwen25vl_tiny.safetensors", "hunyuan_vae.safetensors",
                     "hunyuan_vae_full.safetensors", "hunyuan_video_h128.safetensors", "taehv_hunyuan.safetensors",
                     "hunyuan_video_byt5.safetensors", "byt5_tiny.safetensors"],
        "cases": [
            _case("hv_defaults", HUNYUAN, {k: v for k, v in _params(steps=2, w=32, h=32).items()
                                           if k != "sample_params.guidance.txt_cfg"},
                  note="the reference's defaults (sampler, schedule, flow shift, cfg 7 with the empty negative prompt)"),
            _case("hv_cfg1", HUNYUAN, _params(steps=2, w=32, h=32, prompt="a red apple on a wooden table")),
            _case("hv_cfg4_negative", HUNYUAN, _params(steps=2, w=32, h=32, cfg=4.0, negative_prompt="blurry, static")),
            _case("hv_64x32_shift3_9frames", HUNYUAN, _params(steps=2, frames=9, w=64, h=32, seed=123,
                                                               **{"sample_params.flow_shift": 3.0})),
            _case("hv_i2v", {**HUNYUAN, "vae_path": "{fx}/hunyuan_vae_full.safetensors"},
                  _params(steps=2, init_image="init_64.png"),
                  note="the start picture encoded alone (the VAE with its encoder) is the first latent frame of the "
                       "transformer's concatenated conditioning, with a frame mask"),
            _case("hv_first_last_cfg3", {**HUNYUAN, "vae_path": "{fx}/hunyuan_vae_full.safetensors"},
                  _params(steps=2, cfg=3.0, seed=7, init_image="init_64.png", end_image="end_64.png",
                          negative_prompt="blurry"),
                  note="start and end pictures: each encoded alone into the first and the last latent frame"),
            _case("hv_tae", {**HUNYUAN, "taesd_path": "{fx}/taehv_hunyuan.safetensors"}, _params(steps=2, w=32, h=32),
                  note="the tiny video autoencoder (32 latent channels, 2x2 patches) decodes instead of the VAE"),
            _case("hv_i2v_tae", {**HUNYUAN, "taesd_path": "{fx}/taehv_hunyuan.safetensors"},
                  _params(steps=2, init_image="init_64.png"),
                  note="the tiny video autoencoder's encoder makes the start picture's latent frame"),
            _case("hv_byt5_glyphs", HUNYUAN_BYT5,
                  _params(steps=2, w=32, h=32, prompt="a shop sign that says \"OPEN\" and \u201ccafe\u201d"),
                  note="the glyph encoder (t5xxl_path): the quoted text as 'Text \"OPEN\". Text \"cafe\". ' in ByT5 "
                       "bytes, mapped by byt5_in and put before the prompt's tokens (the DiT has cond_type_embedding)"),
            _case("hv_byt5_cfg3_negative_quotes", HUNYUAN_BYT5,
                  _params(steps=2, w=32, h=32, seed=7, cfg=3.0, prompt="a banner reading \u2018sale\u2019",
                          negative_prompt="the word \"closed\""),
                  note="quotes in both prompts: each condition has its own glyph tokens"),
            _case("hv_byt5_no_quotes", HUNYUAN_BYT5, _params(steps=2, w=32, h=32, prompt="a red apple on a wooden table"),
                  note="no quoted text: no glyph tokens"),
            _case("hv_byt5_without_mapper", {**HUNYUAN, "t5xxl_path": "{fx}/byt5_tiny.safetensors"},
                  _params(steps=2, w=32, h=32, prompt="a shop sign that says \"OPEN\""),
                  note="a glyph encoder with a DiT without byt5_in: the reference counts the glyph tokens in its "
                       "rotary table but never adds them and aborts; ours renders without them, with a warning"),
            _case("hv_i2v_decoder_only", HUNYUAN, _params(steps=1, w=32, h=32, init_image="init_64.png"),
                  note="an init image with the decoder-only VAE: the reference cannot encode it and fails; ours too"),
            _case("hv_hidden128", {**HUNYUAN, "diffusion_model_path": "{fx}/hunyuan_video_h128.safetensors"},
                  _params(steps=1, w=32, h=32),
                  note="a 128-wide DiT: the reference reads 2048 / 128 = 16 heads of 8 and asserts (heads of 128 "
                       "for its RoPE); ours must fail cleanly"),
        ],
    },
    "ltx": {
        # LTX-2.3: the joint audio-video DiT (ltx.safetensors), Gemma 3 (3840 x 48 layers, every
        # state projected by ltx_connectors' text_embedding_projection; 2.3e9 + 7.2e8 weights sharing
        # bytes: mmap), the LTX video VAE; no audio_vae_path, so no sound. Each Gemma encode pads
        # the prompt to 1024 tokens (about 4.7 TFLOP): few cases. Its defaults: euler, the ltx2
        # schedule, flow shift 2.37 (unused by ltx2), cfg 7 with the empty negative prompt
        "model": "ltx.safetensors",
        "fixtures": ["ltx.safetensors", "gemma3_ltx.safetensors", "ltx_connectors.safetensors", "ltx_vae.safetensors",
                     "taehv_ltx.safetensors", "ltx_vae_i2v.safetensors", "ltx_connectors_full.safetensors",
                     "ltx_vae_ts.safetensors", "ltx_upscaler.safetensors"],
        "cases": [
            _case("ltx_cfg1_9frames", LTX, _params(steps=2, frames=9)),
            _case("ltx_tae_9frames", {**LTX, "taesd_path": "{fx}/taehv_ltx.safetensors"}, _params(steps=2, frames=9),
                  note="the tiny video autoencoder (128 latent channels, 4x4 patches, 8 frames a latent frame) "
                       "decodes instead of the LTX VAE"),
            _case("ltx_cfg3_negative_96x64_17frames", LTX, _params(steps=2, frames=17, w=96, h=64, seed=7, cfg=3.0,
                                                                    negative_prompt="blurry, static",
                                                                    prompt="a red fox running through snow")),
            _case("ltx_1frame_fps24", LTX, _params(steps=3, frames=1, seed=123, fps=24)),
            _case("ltx_temporal_tiling_33frames", LTX, _params(steps=2, frames=33, **{"vae_tiling_params.temporal_tiling": True}),
                  note="temporal tiling with its defaults: 5 latent frames decoded as [0, 4) and [3, 5), each "
                       "convolution continuing from the previous tile's frames, the overlap's frames dropped"),
            _case("ltx_temporal_tile2_overlap0_17frames", LTX,
                  _params(steps=2, frames=17, seed=7, **{"vae_tiling_params.temporal_tiling": True,
                                                         "vae_tiling_params.extra_tiling_args":
                                                             "temporal_tile_frames=2,temporal_tile_overlap=0"}),
                  note="tiles of 2 latent frames without overlap: [0, 2) and [2, 3)"),
            _case("ltx_temporal_tile3_overlap2_33frames", LTX,
                  _params(steps=2, frames=33, seed=123, **{"vae_tiling_params.temporal_tiling": True,
                                                           "vae_tiling_params.extra_tiling_args":
                                                               "temporal_tile_frames=3;temporal_tile_overlap=2;tile_frames=9"}),
                  note="tiles of 3 latent frames overlapping by 2 ([0, 3), [1, 4), [2, 5)); an unknown key is "
                       "ignored with a warning"),
            _case("ltx_i2v_9frames", LTX_I2V, _params(steps=2, frames=9, init_image="init_64.png"),
                  note="IMG2VID: the start picture encoded (ltx_vae_i2v's encoder: 8x in time, 32x in space) into "
                       "latent frame 0, whose tokens are denoised from 1 - strength (0.25 by default): their "
                       "timesteps are the mask times the step's, the model's input there blended with the picture"),
            _case("ltx_i2v_strength1_96x64_17frames", LTX_I2V,
                  _params(steps=2, frames=17, w=96, h=64, seed=7, init_image="init_96x64.png", strength=1.0),
                  note="strength 1: the first latent frame is the picture's, kept (mask 0, timestep 0)"),
            _case("ltx_end_image_9frames", LTX_I2V, _params(steps=2, frames=9, seed=123, end_image="end_64.png", strength=0.5),
                  note="END2VID: the end picture's latent frame appended behind the video's as a keyframe (mask 0.5) "
                       "at pixel frame 8 (its own rotary positions), dropped before the decode"),
            _case("ltx_flf2v_1frame", LTX_I2V, _params(steps=2, frames=1, init_image="init_64.png", end_image="end_64.png"),
                  note="one frame: the end picture takes latent frame 0 after the start picture, nothing appended"),
            _case("ltx_i2v_one_level_encoder", LTX, _params(steps=2, frames=9, init_image="init_64.png"),
                  note="ltx_vae's one-level encoder makes a latent 8x smaller than the video's: 'invalid LTXAV init "
                       "condition latent shape', no frames"),
            _case("ltx_connectors_cfg1_9frames", LTX_CONNECTORS, _params(steps=2, frames=9),
                  note="the embeddings connectors (in embeddings_connectors_path under the transformer's names): the "
                       "prompt's states, then learnable registers up to 1024 tokens, through one gated 1-D block with "
                       "rotary positions and a final RMS norm, for each stream's text cross-attention"),
            _case("ltx_connectors_cfg3_negative_96x64", LTX_CONNECTORS,
                  _params(steps=2, frames=9, w=96, h=64, seed=7, cfg=3.0, negative_prompt="blurry, static",
                          prompt="a red fox running through snow"),
                  note="the connectors with a negative prompt of another length at cfg 3"),
            _case("ltx_tae_i2v_9frames", {**LTX, "taesd_path": "{fx}/taehv_ltx.safetensors"},
                  _params(steps=2, frames=9, init_image="init_64.png", end_image="end_64.png", strength=0.9),
                  note="FLF2V through the tiny video autoencoder: its encoder makes the start and end latents, its "
                       "decoder the frames"),
            _case("ltx_hires_upscale_9frames", LTX, _params(steps=2, frames=9, **LTX_HIRES),
                  note="the latent-upscale refine pass: the sampled latent (un-normalised by the VAE's statistics) "
                       "through ltx_upscaler (2x in space), normalised again, then sampled from the tail of a "
                       "5-step schedule (2 steps / strength 0.4) at 128x128 with new noise"),
            _case("ltx_hires_temporal_9frames", LTX,
                  _params(steps=2, frames=9, seed=5, **{**LTX_HIRES, "hires.model_path": "{fx}/ltx_upscaler_temporal.safetensors"}),
                  note="the temporal upsampler (2 latent frames -> 3: 17 frames) in the refine pass"),
            _case("ltx_hires_rational_9frames", LTX,
                  _params(steps=2, frames=9, seed=6, **{**LTX_HIRES, "hires.model_path": "{fx}/ltx_upscaler_rational.safetensors"}),
                  note="the rational x1.5 upsampler (3x3 pixel shuffle, binomial blur with stride 2: a 2x2 latent "
                       "becomes 3x3, 96x96) in the refine pass"),
            _case("ltx_hires_i2v_9frames", LTX_I2V, _params(steps=2, frames=9, seed=7, init_image="init_64.png", **LTX_HIRES),
                  note="the refine pass after IMG2VID: the start picture encoded again at the upscaled size into "
                       "latent frame 0, kept (strength 1) during the refine"),
            _case("ltx_vae_timestep_9frames", LTX_VAE_TS, _params(steps=2, frames=9, seed=7),
                  note="the timestep-conditioned VAE decoder: decode timestep 0.05 times the file's multiplier "
                       "(1000) through each residual level's time embedder and the output's, added to their "
                       "scale/shift tables"),
            _case("ltx_vae_timestep_temporal_tiling_17frames", LTX_VAE_TS,
                  _params(steps=2, frames=17, **{"vae_tiling_params.temporal_tiling": True,
                                                 "vae_tiling_params.extra_tiling_args": "temporal_tile_frames=2"}),
                  note="the timestep-conditioned decoder in temporal tiles of 2 latent frames overlapping by 1"),
        ],
    },
    "ltx-audio": {
        # The ltx set's model with sound: audio_vae_path is LTX-2.3's audio VAE decoder + vocoder
        # (synth_ltx_audio.py). The DiT's audio latent (8 channels x 16 bins, ceil(frames / fps *
        # 25) steps) is decoded to a log-mel spectrogram (4 x steps - 3 frames, 64 bins, stereo)
        # and the vocoder makes 160 samples a frame at 16 kHz; with the bandwidth extension a
        # second vocoder adds the high band at 48 kHz. Not a case: ltx_audio_vae_wrong (4 latent
        # channels) loads, and after the whole generation the reference aborts in the audio
        # decode (GGML_ASSERT in ggml_reshape_4d, denormalizing 8 x 16 latent values as 4 x 16)
        "model": "ltx.safetensors",
        "fixtures": ["ltx.safetensors", "gemma3_ltx.safetensors", "ltx_connectors.safetensors", "ltx_vae.safetensors",
                     "ltx_audio_vae.safetensors", "ltx_audio_vae_bwe.safetensors", "ltx_audio_vae_no_vocoder.safetensors",
                     "ltx_vae_i2v.safetensors", "ltx_upscaler.safetensors"],
        "cases": [
            _case("ltxa_cfg1_9frames", LTX_SOUND, _params(steps=2, frames=9),
                  note="ltx_cfg1_9frames with sound: 9 frames at fps 16 are 15 audio latent steps, 57 mel frames, "
                       "9120 stereo samples at 16 kHz"),
            _case("ltxa_bwe_cfg1_9frames", {**LTX, "audio_vae_path": "{fx}/ltx_audio_vae_bwe.safetensors"},
                  _params(steps=2, frames=9),
                  note="the same request with the bandwidth extension: 27360 stereo samples at 48 kHz"),
            _case("ltxa_17frames_fps12", LTX_SOUND, _params(steps=2, frames=17, fps=12),
                  note="17 frames at fps 12: 36 audio latent steps (ceil(17 / 12 * 25)), 141 mel frames, 22560 samples"),
            _case("ltxa_vae_no_vocoder", {**LTX, "audio_vae_path": "{fx}/ltx_audio_vae_no_vocoder.safetensors"},
                  _params(steps=2, frames=9),
                  note="an audio VAE file without the vocoder: the reference falls back to its default (full-size) "
                       "layout, misses those tensors and new_sd_ctx fails"),
            _case("ltxa_flf2v_9frames", {**LTX_SOUND, "vae_path": "{fx}/ltx_vae_i2v.safetensors"},
                  _params(steps=2, frames=9, seed=7, init_image="init_64.png", end_image="end_64.png"),
                  note="FLF2V with sound: the end picture's latent frame appended (3 latent frames), the audio "
                       "packed behind the video over all 3 and its tokens at the step's timestep"),
            _case("ltxa_hires_temporal_9frames", LTX_SOUND,
                  _params(steps=2, frames=9, seed=4, **{**LTX_HIRES, "hires.model_path": "{fx}/ltx_upscaler_temporal.safetensors"}),
                  note="the temporal upsampler with sound: 17 frames after the upscale, the audio latent resized to "
                       "their length"),
            _case("ltxa_hires_flf2v_9frames", {**LTX_SOUND, "vae_path": "{fx}/ltx_vae_i2v.safetensors"},
                  _params(steps=2, frames=9, seed=7, init_image="init_64.png", end_image="end_64.png",
                          **{**LTX_HIRES, "hires.steps": 3, "hires.target_width": 100}),
                  note="the refine pass after FLF2V with sound: the audio unpacked before the upscale and packed "
                       "again behind it, both pictures encoded again at 128x128 (the end one into the appended "
                       "keyframe), 3 hires steps; a hires target the upsampler does not make is warned about"),
        ],
    },
    "minimax-h3": {
        # MiniMax-H3: the joint audio-video DiT (minimax_h3.safetensors), layer 50 of a 51-layer
        # Qwen3-VL text model, the transformer-decoder video VAE (2.9e9 weights sharing bytes: mmap);
        # no audio_vae_path, so no sound (the reference returns none either). Its defaults: euler,
        # the discrete schedule, flow shift 12 (the audio's 3), cfg 7 with the empty negative prompt
        "model": "minimax_h3.safetensors",
        "fixtures": ["minimax_h3.safetensors", "qwen3vl_51.safetensors", "minimax_h3_vae.safetensors",
                     "qwen3_tiny.safetensors", "qwen25vl_tiny.safetensors", "minimax_h3_audio_vae.safetensors",
                     "minimax_h3_audio_vae_wrong.safetensors", "lingbot_video.safetensors", "qwen3vl_tiny80.safetensors",
                     "wan_vae.safetensors", "taehv_minimax.safetensors", "qwen3vl_vision_deepstack80.safetensors"],
        "cases": [
            _case("mm_cfg1", MINIMAX, _params(steps=2)),
            _case("mm_defaults_empty_negative", MINIMAX, {k: v for k, v in _params(steps=2).items()
                                                          if k != "sample_params.guidance.txt_cfg"},
                  note="the defaults: cfg 7 with the empty negative prompt, which gives the LLM no tokens: the "
                       "reference aborts in the LLM's graph; ours must fail cleanly"),
            _case("mm_cfg4_negative", MINIMAX, _params(steps=2, cfg=4.0, negative_prompt="blurry, static")),
            _case("mm_96x64_9frames_to_22", MINIMAX, _params(steps=2, frames=9, w=96, h=64, seed=7,
                                                             prompt="a red fox running through snow"),
                  note="9 frames are aligned up to 22 (17k + 5): 7 latent frames, one decoder chunk"),
            _case("mm_shift5_fps16", MINIMAX, _params(steps=3, seed=123, fps=16, **{"sample_params.flow_shift": 5.0}),
                  note="flow shift 5 moves the audio's sigmas too; fps 16 is overridden to 24"),
            _case("mm_39frames_two_chunks", MINIMAX, _params(steps=1, frames=39, seed=5),
                  note="12 latent frames: two decoder chunks cross-faded over 5 frames"),
            _case("mm_tae", {**{k: v for k, v in MINIMAX.items() if k != "vae_path"}, "taesd_path": "{fx}/taehv_minimax.safetensors"},
                  _params(steps=2),
                  note="the tiny video autoencoder (24 latent channels, 2x2 patches) decodes; no VAE file"),
            _case("mm_tae_39frames", {**MINIMAX, "taesd_path": "{fx}/taehv_minimax.safetensors"},
                  _params(steps=1, frames=39, w=96, h=64, seed=5),
                  note="12 latent frames through the tiny video autoencoder: 45 frames cut into chunks of 20 that keep "
                       "17, the last 12 dropped (frames 17-19 and 37-39 are not in the video)"),
            _case("mm_tae_sound_22frames", {**MINIMAX_SOUND, "taesd_path": "{fx}/taehv_minimax.safetensors"},
                  _params(steps=1, frames=22, seed=3),
                  note="the tiny video autoencoder with sound: the audio latent packed behind the video's channels is "
                       "decoded by the audio VAE, the video's 24 channels by the TAE"),
            _case("mm_llm_as_wide_as_dit", {**MINIMAX, "llm_path": "{fx}/qwen3_tiny.safetensors"}, _params(steps=2),
                  note="a 64-wide, 36-layer LLM: its normed last state (no layer 50) as wide as the DiT, which "
                       "then skips condition_proj and the token refiner"),
            _case("mm_llm_qwen25vl_refused", {**MINIMAX, "llm_path": "{fx}/qwen25vl_tiny.safetensors"}, _params(steps=1),
                  note="a Qwen2.5-VL text model (3584 wide, no q/k norms) is not the Qwen3-VL MiniMax-H3 reads"),
            _case("mm_sound_cfg1", MINIMAX_SOUND, _params(steps=2),
                  note="with its audio VAE: 5 frames at 24 fps are 8 audio latent steps, 6400 stereo samples at 32 kHz"),
            _case("mm_sound_cfg4_negative_seed7", MINIMAX_SOUND,
                  _params(steps=2, cfg=4.0, seed=7, fps=16, negative_prompt="blurry, static",
                          prompt="a red fox barking in the snow"),
                  note="another seed, prompt and guidance; fps 16 is overridden to 24, so the sound is as long"),
            _case("mm_sound_22frames", MINIMAX_SOUND, _params(steps=1, frames=22, seed=3),
                  note="22 frames: 37 audio latent steps (round(22 * 40 / 24)), 29600 samples"),
            _case("mm_sound_vae_wrong_layout", {**MINIMAX, "audio_vae_path": "{fx}/minimax_h3_audio_vae_wrong.safetensors"},
                  _params(steps=1),
                  note="dec_in_proj reads 16 latent channels, not 32: the reference's new_sd_ctx fails (model "
                       "metadata validation)"),
            _case("mm_sound_vae_on_lingbot", {**LINGBOT, "audio_vae_path": "{fx}/minimax_h3_audio_vae.safetensors"},
                  _params(steps=1),
                  note="a family without sound: the reference reads the file as LTX-2.3's audio VAE, misses its "
                       "tensors and new_sd_ctx fails"),
            _case("mm_i2va", MINIMAX, _params(steps=2, init_image="init_64.png"),
                  note="I2VA: the start picture through the VAE's encoder (causal 3-D convolutions, 4 tiles of 16 "
                       "latent pixels forced), moved 0.1% towards Philox noise of the seed, as tokens in front of "
                       "the audio at the first frame's time, modulated for timestep max(t, 0.999), not denoised"),
            _case("mm_fl2va_cfg3_negative_seed7", MINIMAX,
                  _params(steps=2, cfg=3.0, seed=7, negative_prompt="blurry, static", init_image="init_64.png",
                          end_image="end_64.png"),
                  note="FL2VA: start and end keyframes (the end one at the last latent frame's time, the same noise), "
                       "both passes see them"),
            _case("mm_end_frame_96x64_22frames", MINIMAX,
                  _params(steps=2, frames=22, w=96, h=64, seed=5, end_image="end_96x64.png"),
                  note="end-frame conditioning alone, 7 latent frames (two decoder chunks)"),
            _case("mm_sound_i2va_seed3", MINIMAX_SOUND, _params(steps=2, seed=3, init_image="init_96x64.png"),
                  note="I2VA with sound; the 96x64 start picture resized to the 64x64 request before encoding"),
            _case("mm_ref2va_image", MINIMAX, _params(steps=2, seed=11, ref_images=["end_64.png"]),
                  note="Ref2VA with one reference picture: encoded like a keyframe, its tokens before the audio at "
                       "the text's end, the audio and video one time unit later"),
            _case("mm_ref2va_two_images_cfg3_96x64", MINIMAX,
                  _params(steps=2, cfg=3.0, w=96, h=64, frames=9, negative_prompt="blurry",
                          ref_images=["init_96x64.png", "end_64.png", "vace_ctrl_96x64_2.png"]),
                  note="three reference pictures at a 96x64 request (22 frames): 96x64 is kept, 64x64 too (within "
                       "the request's area, sides rounded to 32), each its own time unit"),
            _case("mm_ref2va_scaled_down", MINIMAX, _params(steps=1, seed=4, ref_images=["init_96x64.png"]),
                  note="a 96x64 reference picture for a 64x64 request: scaled by nearest neighbour to the request's "
                       "area (64x64 after rounding to 32)"),
            _case("mm_ref2va_video", MINIMAX,
                  _params(steps=2, seed=21, ref_videos=[{"frames": _ctrl(5), "fps": 24}]),
                  note="Ref2VA with a 5-frame reference video at 24 fps: padded to 17 frames with its last, encoded "
                       "(5 latent frames, the last 3 dropped), its tokens' times advancing like the video's"),
            _case("mm_ref2va_image_and_video_fps12_96x64", MINIMAX,
                  _params(steps=2, w=96, h=64, frames=22, seed=9, ref_images=["end_64.png"],
                          ref_videos=[{"frames": _ctrl(5, "96x64"), "fps": 12}]),
                  note="a picture then a 12 fps video (10 frames at 24 fps, cut to 5: each frame shown twice)"),
            _case("mm_ref2va_audio", MINIMAX_SOUND,
                  _params(steps=2, seed=13, ref_audios=[{"sample_rate": 16000, "channels": 1, "samples": 6000, "period": 97}]),
                  note="Ref2VA with a reference sound (16 kHz mono, resampled to 32 kHz stereo: 12000 samples, 15 "
                       "steps) through the audio VAE's encoder, its tokens at the text's end on both edges, modulated "
                       "for timestep max(t_a, 1); the audio and video 15 time units later"),
            _case("mm_ref2va_video_with_sound_and_audio", MINIMAX_SOUND,
                  _params(steps=2, seed=17, ref_videos=[{"frames": _ctrl(5), "fps": 24,
                                                         "audio": {"sample_rate": 22050, "channels": 1, "samples": 4000,
                                                                   "period": 61}}],
                          ref_audios=[{"sample_rate": 48000, "channels": 2, "samples": 9000, "period": 113}]),
                  note="a reference video with its sound (22.05 kHz: fractional resampling positions) and a 48 kHz "
                       "stereo sound after it"),
            _case("mm_ref2va_audio_without_audio_vae", MINIMAX,
                  _params(steps=1, ref_audios=[{"sample_rate": 16000, "channels": 1, "samples": 1600, "period": 50}]),
                  note="reference sound without an audio VAE: refused by the reference, no frames"),
            _case("mm_tae_fl2va", {**MINIMAX, "taesd_path": "{fx}/taehv_minimax.safetensors"},
                  _params(steps=2, seed=3, init_image="init_64.png", end_image="end_64.png"),
                  note="keyframes through the tiny video autoencoder's encoder: each picture padded to 17 frames "
                       "behind 3 zero frames, 5 latent frames less the last 3: two latent frames a keyframe"),
            _case("mm_tae_ref2va_video_96x64", {**MINIMAX, "taesd_path": "{fx}/taehv_minimax.safetensors"},
                  _params(steps=2, w=96, h=64, frames=22, seed=8, ref_videos=[{"frames": _ctrl(5, "96x64"), "fps": 24}]),
                  note="a reference video through the tiny video autoencoder's encoder"),
            _case("mm_ref2va_with_keyframe_refused", MINIMAX,
                  _params(steps=1, init_image="init_64.png", ref_images=["end_64.png"]),
                  note="keyframes and Ref2VA references together: refused by the reference, no frames"),
            _case("mm_vision_i2va", MINIMAX_VISION, _params(steps=2, seed=6, init_image="init_64.png"),
                  note="with a vision tower (24 blocks: deepstack mergers after blocks 5, 11, 17) the LLM is shown "
                       "the start picture: '<Picture 1>: ' and its 56x56 embeddings (4 tokens) before the prompt, "
                       "the deepstack embeddings added after LLM layers 1-3, multi-section positions of its grid"),
            _case("mm_vision_fl2va_cfg3_96x64", MINIMAX_VISION,
                  _params(steps=2, cfg=3.0, w=96, h=64, frames=9, seed=8, negative_prompt="blurry",
                          init_image="init_96x64.png", end_image="end_96x64.png"),
                  note="start and end pictures shown at 84x56 (a 3x2 token grid) to both prompts"),
            _case("mm_vision_ref2va_mixed_sound", MINIMAX_VISION_SOUND,
                  _params(steps=2, seed=12, frames=22, ref_images=["init_96x64.png"],
                          ref_videos=[{"frames": MM_VIDEO_11, "fps": 12,
                                       "audio": {"sample_rate": 16000, "channels": 1, "samples": 3000, "period": 71}}],
                          ref_audios=[{"sample_rate": 24000, "channels": 1, "samples": 2400, "period": 37}]),
                  note="Ref2VA shown to the LLM: '<Picture 1>: ' (the picture scaled to 64x64), '<Audio 1>: ' "
                       "(the video's sound), '<Video 1>: <0.2 seconds>' with frames 0 and 12 as one two-frame "
                       "vision block, '<Audio 2>: '"),
        ],
    },
    "lingbot": {
        # LingBot Video: the MoE DiT (lingbot_video.safetensors), Qwen3-VL's text model (its
        # normed final state), with llm_vision_path its vision tower for the init image, and the
        # Wan2.1 VAE; its defaults: euler, the discrete schedule, flow shift 3, cfg 7 with the
        # empty negative prompt
        "model": "lingbot_video.safetensors",
        "fixtures": ["lingbot_video.safetensors", "qwen3vl_tiny80.safetensors", "qwen3vl_vision_tiny80.safetensors",
                     "wan_vae.safetensors", "qwen3_tiny.safetensors"],
        "cases": [
            _case("lingbot_defaults", LINGBOT, {k: v for k, v in _params(steps=2).items()
                                                if k != "sample_params.guidance.txt_cfg"},
                  note="the reference's defaults (sampler, schedule, flow shift, cfg 7 with the empty negative prompt)"),
            _case("lingbot_cfg1", LINGBOT, _params(steps=2)),
            _case("lingbot_cfg4_negative", LINGBOT, _params(steps=2, cfg=4.0, negative_prompt="blurry, static")),
            _case("lingbot_96x64_9frames", LINGBOT, _params(steps=2, frames=9, w=96, h=64, seed=7,
                                                             prompt="a red fox running through snow")),
            _case("lingbot_i2v_end_image_ignored", LINGBOT, _params(steps=2, init_image="init_64.png",
                                                                     end_image="end_64.png"),
                  note="the init image's latent is the first latent frame, kept by the denoise mask; without a "
                       "vision tower the LLM reads the prompt only; the end image is not used"),
            _case("lingbot_i2v_vision", LINGBOT_VISION, _params(steps=2, init_image="init_64.png"),
                  note="with llm_vision_path the init image also goes to the LLM through the vision tower"),
            _case("lingbot_i2v_vision_cfg3_negative", LINGBOT_VISION,
                  _params(steps=2, cfg=3.0, w=96, h=64, seed=123, init_image="init_96x64.png",
                          negative_prompt="blurry, static")),
            _case("lingbot_llm_width_mismatch", {**LINGBOT, "llm_path": "{fx}/qwen3_tiny.safetensors"}, _params(steps=1),
                  note="a 64-wide LLM for a DiT whose text embedder takes 80: the reference aborts in ggml_mul_mat; "
                       "ours must fail cleanly"),
        ],
    },
    "wan-moe": {
        "model": "wan21_t2v_prefixed.safetensors",
        "fixtures": ["wan21_t2v_prefixed.safetensors", "wan21_t2v.safetensors", "umt5_tiny.safetensors",
                     "wan_vae.safetensors", "loras/lora_wan_comfy.safetensors"],
        "cases": [
            _case("moe_boundary_high_noise_params", MOE,
                  _params(steps=4, moe_boundary=0.9,
                          **{"high_noise_sample_params.sample_steps": -1,
                             "high_noise_sample_params.sample_method": "EULER_A_SAMPLE_METHOD",
                             "high_noise_sample_params.guidance.txt_cfg": 1.0,
                             "sample_params.sample_method": "DPMPP2M_SAMPLE_METHOD"})),
            _case("moe_high_noise_lora", MOE,
                  _params(steps=2, **{"high_noise_sample_params.sample_steps": 2,
                                      "high_noise_sample_params.guidance.txt_cfg": 1.0},
                          loras=[_lora("lora_wan_comfy.safetensors", 1.0, high_noise=True)])),
        ],
    },
}

# ------------------------------------------------------------------------------ running


def run_case(lib, case, prefix, threads, log):
    """One child-process run of `case`: (result dict, [frame arrays]). A run killed by a
    signal gives {"crashed": signal number, "rc", "why": the abort message}."""
    result_path = prefix + ".json"
    cmd = [sys.executable, os.path.join(HERE, "sd_capi.py"), "--lib", lib, "--case",
           json.dumps({"ctx": case["ctx"], "params": case["params"]}), "--video", "--out", prefix,
           "--result", result_path, "--threads", str(threads), "--log"]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not os.path.exists(result_path):
        with open(log, errors="replace") as f:
            lines = f.read().replace("\r", "\n").splitlines()
        # ggml_abort prints its message, then a gdb backtrace: the message says why
        why = [ln for ln in lines if any(k in ln for k in ("GGML_ASSERT", "GGML_ABORT", "terminate called", "what():"))]
        return {"crashed": -rc if rc < 0 else None, "rc": rc, "why": (why or lines[-1:] or [""])[0].strip()}, []
    with open(result_path) as f:
        result = json.load(f)
    frames = []
    for i in range(result.get("frames", 0)):
        w, h, ch, img = decode_png(f"{prefix}_{i}.png")
        frames.append(img.reshape(h, w, ch).astype(np.int16))
    if result.get("audio"):
        result["samples"] = read_wav(prefix + ".wav")
    return result, frames


def read_wav(path):
    """The float samples of a WAVE_FORMAT_IEEE_FLOAT file written by sd_capi.py."""
    with open(path, "rb") as f:
        data = f.read()
    at = data.index(b"data") + 8
    return np.frombuffer(data[at:], dtype="<f4")


def sound_diff(a, b):
    """max and mean |difference| of two sounds' samples (inf when their lengths differ)."""
    if a.shape != b.shape:
        return float("inf"), float("inf")
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return float(d.max()), float(d.mean())


def diff(a, b):
    if a.shape != b.shape:
        return float("inf"), float("inf")
    d = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return int(d.max()), float(d.mean())


def load_cases(path):
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None


def write_json(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


def render(a):
    spec = SETS[a.set]
    os.makedirs(a.out, exist_ok=True)
    cases_path = os.path.join(a.out, "cases.json")
    old = load_cases(cases_path) or {}
    records = {c["name"]: c for c in old.get("cases", [])}
    work = a.keep or tempfile.mkdtemp(prefix="golden-video-")
    failed = False
    for case in spec["cases"]:
        if a.only and case["name"] not in a.only:
            continue
        runs = []
        for k in range(a.repeat):
            d = os.path.join(work, f"run{k}")
            os.makedirs(d, exist_ok=True)
            t0 = time.monotonic()
            result, frames = run_case(a.lib, case, os.path.join(d, case["name"]), a.threads,
                                      os.path.join(d, case["name"] + ".log"))
            print(f"{case['name']} run {k + 1}: {'crashed' if 'crashed' in result else 'ok' if result['ok'] else 'failed'}"
                  f", {len(frames)} frames, {result.get('seconds', '-')} s generate_video"
                  f" ({time.monotonic() - t0:.0f} s in all)", flush=True)
            runs.append((result, frames))
        first, frames = runs[0]
        same = all(("crashed" in r) == ("crashed" in first) and r.get("ok") == first.get("ok") and len(f) == len(frames)
                   and all(diff(x, y)[0] == 0 for x, y in zip(f, frames))
                   and (r.get("audio") is None) == (first.get("audio") is None)
                   and (first.get("audio") is None or sound_diff(r["samples"], first["samples"])[0] == 0)
                   for r, f in runs[1:])
        if not same:
            print(f"  {case['name']}: the runs differ; not recorded", flush=True)
            failed = True
            continue
        rec = {"name": case["name"], "ctx": case["ctx"], "params": case["params"]}
        if "crashed" in first:
            # "frames" marks a generate_video case (a crash without it is generate_image's)
            rec.update(ok=None, images=[], frames=0, reference_crashed=True,
                       note=f"the library died (signal {first['crashed']}): {first['why'][:300]}")
        else:
            names = [f"{case['name']}_{i}.png" for i in range(len(frames))]
            for i, n in enumerate(names):
                shutil.copyfile(os.path.join(work, "run0", n), os.path.join(a.out, n))
            sound = None
            if first.get("audio"):
                sound = {"file": case["name"] + ".wav", **first["audio"]}
                shutil.copyfile(os.path.join(work, "run0", sound["file"]), os.path.join(a.out, sound["file"]))
            rec.update(ok=first["ok"], images=names, frames=len(frames), audio=sound)
            if "seconds" in first:
                rec["seconds"] = first["seconds"]
            if not first["ok"]:
                rec["errors"] = first.get("errors", [])
                if "ctx_failed" in first:
                    rec["ctx_failed"] = first["ctx_failed"]
        if "tolerance" in case:
            rec["tolerance"] = case["tolerance"]
        if "note" in case:
            rec["note"] = case["note"] + ("; " + rec["note"] if "note" in rec else "")
        records[case["name"]] = rec
        order = [c["name"] for c in spec["cases"]]
        ordered = [records[n] for n in order if n in records] + [r for n, r in records.items() if n not in order]
        write_json(cases_path, {
            "model": spec["model"],
            "fixtures": spec["fixtures"],
            "made_with": old.get("made_with") or a.made_with,
            "repeat": a.repeat,
            "cases": ordered,
        })
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def check(a):
    data = load_cases(os.path.join(a.golden, "cases.json"))
    work = a.keep or tempfile.mkdtemp(prefix="golden-video-check-")
    os.makedirs(work, exist_ok=True)
    bad = 0
    for case in data["cases"]:
        if a.only and case["name"] not in a.only:
            continue
        if case.get("reference_crashed"):
            print(f"{case['name']}: reference_crashed case, skipped")
            continue
        prefix = os.path.join(work, case["name"])
        if a.ctx:
            case = dict(case, ctx={**case["ctx"], **a.ctx})
        result, frames = run_case(a.lib, case, prefix, a.threads, prefix + ".log")
        if "crashed" in result:
            print(f"{case['name']}: CRASHED (signal {result['crashed']}, exit {result['rc']})")
            bad += 1
            continue
        if result["ok"] != case["ok"] or len(frames) != len(case["images"]):
            print(f"{case['name']}: FAIL ok {result['ok']} (golden {case['ok']}), {len(frames)} frames "
                  f"(golden {len(case['images'])})")
            bad += 1
            continue
        tol = case.get("tolerance", {})
        max_ok, mean_ok = (0, 0.0) if a.exact else (tol.get("max", MAX_DIFF), tol.get("mean", MEAN_DIFF))
        worst = (0, 0.0)
        for f, n in zip(frames, case["images"]):
            w, h, ch, img = decode_png(os.path.join(a.golden, n))
            m, mean = diff(f, img.reshape(h, w, ch))
            worst = (max(worst[0], m), max(worst[1], mean))
        ok = worst[0] <= max_ok and worst[1] <= mean_ok
        sound = ""
        if case.get("audio") or result.get("audio"):
            if not case.get("audio") or not result.get("audio"):
                ok, sound = False, f", sound {'missing' if case.get('audio') else 'unexpected'}"
            else:
                m, mean = sound_diff(result["samples"], read_wav(os.path.join(a.golden, case["audio"]["file"])))
                ok = ok and m <= SOUND_MAX_DIFF
                sound = f", sound max {m:.2e} mean {mean:.2e} (allowed {SOUND_MAX_DIFF})"
        bad += not ok
        print(f"{case['name']}: {'ok' if ok else 'FAIL'} {len(frames)} frames, max {worst[0]}, mean {worst[1]:.4f}"
              f" (allowed {max_ok} / {mean_ok}){sound}, {result.get('seconds')} s", flush=True)
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("inputs")
    sub.add_parser("list")
    for name in ("render", "check"):
        p = sub.add_parser(name)
        p.add_argument("--lib", required=True)
        p.add_argument("--only", nargs="*")
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--keep", help="folder for each run's frames and logs (kept)")
        if name == "render":
            p.add_argument("--set", required=True, choices=sorted(SETS))
            p.add_argument("--out", required=True)
            p.add_argument("--repeat", type=int, default=2)
            p.add_argument("--made-with", default="stable-diffusion.cpp 97d29908, bench/build-reference.sh --avx2 "
                                                  "(ggml of llama-cpp-sys-2 0.1.161), n_threads 1")
        else:
            p.add_argument("--golden", required=True)
            p.add_argument("--exact", action="store_true")
            p.add_argument("--ctx", nargs="*", default=[], metavar="KEY=JSON",
                           help="context fields to override (JSON values, e.g. diffusion_flash_attn=true)")
    a = ap.parse_args()
    if a.cmd == "inputs":
        write_inputs()
        return 0
    if a.cmd == "list":
        for name, spec in SETS.items():
            print(f"{name}: {', '.join(spec['fixtures'])}")
            for c in spec["cases"]:
                print(f"  {c['name']}")
        return 0
    a.lib = os.path.abspath(a.lib)
    if a.cmd == "check":
        a.ctx = {k: json.loads(v) for k, v in (item.split("=", 1) for item in a.ctx)}
    return render(a) if a.cmd == "render" else check(a)


if __name__ == "__main__":
    sys.exit(main())
