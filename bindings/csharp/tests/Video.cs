// Video generation through the C# bindings: a VideoRequest with every field Wan uses
// reaches sd_vid_gen_params_t (no model needed), failures throw, and, with the Wan fixtures
// and SD_PARITY set, golden case wan/wan_cfg1_9frames renders through Sd.GenerateVideo.
using System;
using System.Collections.Generic;
using System.IO;
using System.Runtime.InteropServices;
using StableDiffusion;

static class VideoTests
{
    static SdImage Frame(int seed, int w = 8, int h = 6)
    {
        var data = new byte[w * h * 3];
        for (int i = 0; i < data.Length; i++) data[i] = (byte)((seed + i * 7) % 256);
        return new SdImage(w, h, 3, data);
    }

    static byte[] Bytes(sd_image_t img)
    {
        var b = new byte[img.width * img.height * img.channel];
        Marshal.Copy(img.data, b, 0, b.Length);
        return b;
    }

    static sd_image_t At(IntPtr arr, int i)
    {
        return (sd_image_t)Marshal.PtrToStructure(new IntPtr(arr.ToInt64() + i * Marshal.SizeOf(typeof(sd_image_t))), typeof(sd_image_t));
    }

    static bool Same(byte[] a, byte[] b)
    {
        if (a.Length != b.Length) return false;
        for (int i = 0; i < a.Length; i++) if (a[i] != b[i]) return false;
        return true;
    }

    static void Fields(Action<string, bool, string> check)
    {
        var r = new VideoRequest();
        check("request defaults from sd_vid_gen_params_init", r.Params.video_frames == 6 && r.Params.fps == 16 &&
              r.Params.high_noise_sample_params.sample_steps == -1 && r.Params.width == 512, r.Params.video_frames + " frames");
        r.Prompt = "a lovely cat";
        r.NegativePrompt = "blurry";
        r.InitImage = Frame(1);
        r.EndImage = Frame(2);
        r.ControlFrames.AddRange(new[] { Frame(10), Frame(11), Frame(12) });
        r.RefImages.Add(Frame(3));
        var audio = new SdAudio(8000, 2, new[] { 0.0f, 0.5f, -0.5f, 1.0f });
        r.RefVideos.Add(new SdRefVideo { Frames = new List<SdImage> { Frame(20), Frame(21) }, Fps = 24, Audio = audio });
        r.RefAudios.Add(audio);
        r.Loras.Add(new SdLora { Path = "/loras/a.safetensors", Multiplier = 0.8f });
        r.Loras.Add(new SdLora { Path = "/loras/b.safetensors", IsHighNoise = true });
        r.Params.width = 832;
        r.Params.height = 480;
        r.Params.video_frames = 33;
        r.Params.moe_boundary = 0.9f;
        r.Params.vace_strength = 0.7f;
        r.Params.sample_params.sample_steps = 4;
        r.Params.sample_params.sample_method = SampleMethod.EULER;
        r.Params.high_noise_sample_params.sample_steps = 2;
        r.Params.high_noise_sample_params.guidance.txt_cfg = 3.5f;
        r.Params.cache.mode = CacheMode.EASYCACHE;
        r.Params.vae_tiling_params.enabled = true;
        r.Sample.SkipLayers = new[] { 9, 10 };
        r.Sample.CustomSigmas = new[] { 1.0f, 0.5f, 0.0f };
        r.HighNoiseSample.ExtraArgs = "gamma=0.5";
        r.ExtraTilingArgs = "temporal_tile_frames=4";
        using (var arena = new NativeArena())
        {
            var p = Sd.ToNative(r, arena);
            check("video prompt", Sd.PtrToString(p.prompt) == "a lovely cat" && Sd.PtrToString(p.negative_prompt) == "blurry", "");
            check("video init/end images", Same(Bytes(p.init_image), Frame(1).Data) && Same(Bytes(p.end_image), Frame(2).Data), "");
            check("video control frames", p.control_frames_size == 3 && Same(Bytes(At(p.control_frames, 2)), Frame(12).Data), p.control_frames_size.ToString());
            check("video ref images", p.ref_images_count == 1 && Same(Bytes(At(p.ref_images, 0)), Frame(3).Data), "");
            var rv = (sd_ref_video_t)Marshal.PtrToStructure(p.ref_videos, typeof(sd_ref_video_t));
            check("video ref videos", p.ref_videos_count == 1 && rv.frame_count == 2 && rv.fps == 24 && rv.audio.sample_count == 2 &&
                  Same(Bytes(At(rv.frames, 1)), Frame(21).Data), rv.frame_count + " frames");
            var samples = new float[4];
            Marshal.Copy(rv.audio.data, samples, 0, 4);
            check("video ref audio samples", samples[1] == 0.5f && samples[3] == 1.0f && p.ref_audios_count == 1, "");
            var l1 = (sd_lora_t)Marshal.PtrToStructure(new IntPtr(p.loras.ToInt64() + Marshal.SizeOf(typeof(sd_lora_t))), typeof(sd_lora_t));
            check("video loras", p.lora_count == 2 && l1.is_high_noise && l1.multiplier == 1.0f && Sd.PtrToString(l1.path) == "/loras/b.safetensors", "");
            var layers = new int[2];
            Marshal.Copy(p.sample_params.guidance.slg.layers, layers, 0, 2);
            check("video skip layers", p.sample_params.guidance.slg.layer_count.ToUInt64() == 2 && layers[0] == 9 && layers[1] == 10, "");
            check("video custom sigmas", p.sample_params.custom_sigmas_count == 3, "");
            check("video high noise", p.high_noise_sample_params.sample_steps == 2 && p.high_noise_sample_params.guidance.txt_cfg == 3.5f &&
                  Sd.PtrToString(p.high_noise_sample_params.extra_sample_args) == "gamma=0.5" && p.high_noise_sample_params.custom_sigmas == IntPtr.Zero, "");
            check("video value fields", p.width == 832 && p.video_frames == 33 && p.moe_boundary == 0.9f && p.vace_strength == 0.7f &&
                  p.cache.mode == CacheMode.EASYCACHE && p.vae_tiling_params.enabled, "");
            check("video tiling args", Sd.PtrToString(p.vae_tiling_params.extra_tiling_args) == "temporal_tile_frames=4", "");
        }
        bool threw = false;
        try { new SdImage(2, 2, 3, new byte[5]); } catch (ArgumentException) { threw = true; }
        check("SdImage checks its size", threw, "");
    }

    static void Failure(Action<string, bool, string> check)
    {
        bool threw = false;
        try { Sd.GenerateVideo(new SdContextHandle(), new VideoRequest { Prompt = "x" }); }
        catch (SdException) { threw = true; }
        check("GenerateVideo(NULL context) throws", threw, "");
        check("TakeAudio(NULL)", Sd.TakeAudio(IntPtr.Zero) == null, "");
    }

    static string FixtureCache()
    {
        string cache = Environment.GetEnvironmentVariable("SD_FIXTURE_CACHE");
        if (string.IsNullOrEmpty(cache))
            cache = Path.Combine(Environment.GetEnvironmentVariable("HOME") ?? ".", ".cache", "sd-rs-fixtures");
        return cache;
    }

    static void Wan(Action<string, bool, string> check, string repoRoot)
    {
        var files = new[] { "wan21_t2v.safetensors", "umt5_tiny.safetensors", "wan_vae.safetensors" };
        foreach (var f in files)
        {
            if (!File.Exists(Path.Combine(FixtureCache(), f)))
            {
                Console.Error.WriteLine("skipped Wan video: " + f + " is missing (scripts/fixtures.sh wan21-t2v umt5-tiny wan-vae writes it)");
                return;
            }
        }
        if (string.IsNullOrEmpty(Environment.GetEnvironmentVariable("SD_PARITY")))
        {
            Console.Error.WriteLine("skipped Wan video: it takes minutes here, set SD_PARITY=1 to run it");
            return;
        }
        var paths = new IntPtr[3];
        for (int i = 0; i < 3; i++) paths[i] = Sd.AllocString(Path.Combine(FixtureCache(), files[i]));
        try
        {
            var p = new sd_ctx_params_t();
            Native.sd_ctx_params_init(ref p);
            p.n_threads = 2;
            p.diffusion_model_path = paths[0];
            p.t5xxl_path = paths[1];
            p.vae_path = paths[2];
            using (var ctx = Native.new_sd_ctx(ref p))
            {
                check("new_sd_ctx(wan)", !ctx.IsInvalid, "");
                if (ctx.IsInvalid) return;
                var r = new VideoRequest { Prompt = "a lovely cat" };
                r.Params.width = 64;
                r.Params.height = 64;
                r.Params.seed = 42;
                r.Params.video_frames = 9;
                r.Params.sample_params.sample_steps = 3;
                r.Params.sample_params.guidance.txt_cfg = 1.0f;
                var video = Sd.GenerateVideo(ctx, r);
                check("wan frames", video.Frames.Count == 9 && video.Audio == null, video.Frames.Count + " frames");
                string golden = null;
                foreach (var d in new[] { Path.Combine(repoRoot, "tests", "fixtures", "golden", "wan"), Path.Combine(repoRoot, "..", "shared", "fixtures", "golden", "wan") })
                    if (File.Exists(Path.Combine(d, "cases.json"))) { golden = d; break; }
                if (golden == null) return;
                for (int i = 0; i < video.Frames.Count; i++)
                {
                    var f = video.Frames[i];
                    var header = new sd_image_t { width = (uint)f.Width, height = (uint)f.Height, channel = (uint)f.Channel };
                    GenerateTests.CheckGolden(check, golden, "wan_cfg1_9frames_" + i + ".png", header, f.Data);
                }
            }
        }
        finally
        {
            foreach (var ptr in paths) Sd.FreeString(ptr);
        }
    }

    public static void Run(Action<string, bool, string> check, string repoRoot)
    {
        Fields(check);
        Failure(check);
        Wan(check, repoRoot);
    }
}
