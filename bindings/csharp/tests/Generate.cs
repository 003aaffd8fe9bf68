// Generation through the C# bindings: the synthetic SD1 checkpoint must render the
// reference's golden pictures for cases sd1/sampler_euler and (with a LoRA, then without)
// sd1-lora/lora_1_0 and lora_none_after, and the components of flux/flux_defaults and zimage/zimage_cfg1
// (tests/fixtures/golden/*/cases.json).
// The checkpoint comes from the fixture cache ($SD_FIXTURE_CACHE, default
// ~/.cache/sd-rs-fixtures), where scripts/test.sh writes it with scripts/fixtures.sh.
using System;
using System.Collections.Generic;
using System.IO;
using System.IO.Compression;
using StableDiffusion;

static class GenerateTests
{
    // (width, height, channels, bytes) of an 8-bit non-interlaced PNG.
    public static Tuple<int, int, int, byte[]> ReadPng(string path)
    {
        byte[] file = File.ReadAllBytes(path);
        int pos = 8, w = 0, h = 0, ch = 0;
        var idat = new MemoryStream();
        Func<int, int> be32 = o => (file[o] << 24) | (file[o + 1] << 16) | (file[o + 2] << 8) | file[o + 3];
        while (pos + 8 <= file.Length)
        {
            int n = be32(pos);
            string kind = System.Text.Encoding.ASCII.GetString(file, pos + 4, 4);
            if (kind == "IHDR")
            {
                w = be32(pos + 8);
                h = be32(pos + 12);
                if (file[pos + 16] != 8 || file[pos + 20] != 0) throw new Exception("8-bit non-interlaced PNGs only");
                ch = new Dictionary<int, int> { { 0, 1 }, { 2, 3 }, { 4, 2 }, { 6, 4 } }[file[pos + 17]];
            }
            else if (kind == "IDAT") idat.Write(file, pos + 8, n);
            pos += 12 + n;
        }
        // zlib stream: skip the 2-byte header, inflate the deflate body.
        idat.Position = 2;
        var raw = new MemoryStream();
        using (var z = new DeflateStream(idat, CompressionMode.Decompress)) z.CopyTo(raw);
        byte[] r = raw.ToArray();
        int stride = w * ch;
        var outp = new byte[h * stride];
        for (int y = 0; y < h; y++)
        {
            int f = r[y * (stride + 1)], src = y * (stride + 1) + 1, dst = y * stride;
            for (int i = 0; i < stride; i++)
            {
                int a = i >= ch ? outp[dst + i - ch] : 0;
                int b = y > 0 ? outp[dst - stride + i] : 0;
                int c = i >= ch && y > 0 ? outp[dst - stride + i - ch] : 0;
                int pred = 0;
                if (f == 1) pred = a;
                else if (f == 2) pred = b;
                else if (f == 3) pred = (a + b) / 2;
                else if (f == 4)
                {
                    int p = a + b - c, pa = Math.Abs(p - a), pb = Math.Abs(p - b), pc = Math.Abs(p - c);
                    pred = pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
                }
                outp[dst + i] = (byte)(r[src + i] + pred);
            }
        }
        return Tuple.Create(w, h, ch, outp);
    }

    // A returned image against a golden PNG, within the tolerance of tests/fixtures/README.md.
    public static void CheckGolden(Action<string, bool, string> check, string dir, string file, sd_image_t header, byte[] got)
    {
        var want = ReadPng(Path.Combine(dir, file));
        check("golden size " + file, header.width == want.Item1 && header.height == want.Item2 && header.channel == want.Item3,
              header.width + "x" + header.height + "x" + header.channel);
        int max = 0;
        long sum = 0;
        for (int i = 0; i < Math.Min(got.Length, want.Item4.Length); i++)
        {
            int d = Math.Abs(got[i] - want.Item4[i]);
            max = Math.Max(max, d);
            sum += d;
        }
        double mean = (double)sum / want.Item4.Length;
        check("golden " + Path.GetFileName(dir) + "/" + file, got.Length == want.Item4.Length && max <= 3 && mean <= 0.25, "max " + max + " mean " + mean);
    }

    static string FixtureCache()
    {
        string cache = Environment.GetEnvironmentVariable("SD_FIXTURE_CACHE");
        if (string.IsNullOrEmpty(cache))
            cache = Path.Combine(Environment.GetEnvironmentVariable("HOME") ?? ".", ".cache", "sd-rs-fixtures");
        return cache;
    }

    // Renders golden case `golden` (folder/case) from `file` in the fixture cache: "a lovely
    // cat", 64x64, seed 42, 4 Euler steps, v prediction, and compares within the tolerance of
    // tests/fixtures/README.md. With `lora` (a file of the fixture cache), renders it with
    // that LoRA at multiplier 1, then `after` (folder/case) without it on the same context.
    // Returns false when a fixture is missing.
    static bool RenderGolden(Action<string, bool, string> check, string repoRoot, string file, string golden, bool mmap,
                             string lora = null, string after = null)
    {
        string model = Path.Combine(FixtureCache(), file);
        string loraFile = lora == null ? null : Path.Combine(FixtureCache(), lora);
        foreach (var f in new[] { model, loraFile })
        {
            if (f != null && !File.Exists(f))
            {
                Console.Error.WriteLine("skipped generation: " + f + " is missing (scripts/fixtures.sh writes it)");
                return false;
            }
        }
        var p = new sd_ctx_params_t();
        Native.sd_ctx_params_init(ref p);
        p.n_threads = 2;
        p.prediction = Prediction.V;
        p.enable_mmap = mmap;
        IntPtr modelPath = Sd.AllocString(model), prompt = Sd.AllocString("a lovely cat");
        IntPtr loraPath = loraFile == null ? IntPtr.Zero : Sd.AllocString(loraFile);
        var loras = new sd_lora_t[] { new sd_lora_t { is_high_noise = false, multiplier = 1.0f, path = loraPath } };
        var pinned = System.Runtime.InteropServices.GCHandle.Alloc(loras, System.Runtime.InteropServices.GCHandleType.Pinned);
        try
        {
            p.model_path = modelPath;
            using (var ctx = Native.new_sd_ctx(ref p))
            {
                check("new_sd_ctx(" + file + ")", !ctx.IsInvalid, "");
                if (ctx.IsInvalid) return true;
                var ip = new sd_img_gen_params_t();
                Native.sd_img_gen_params_init(ref ip);
                ip.prompt = prompt;
                ip.width = 64;
                ip.height = 64;
                ip.seed = 42;
                ip.sample_params.sample_steps = 4;
                ip.sample_params.sample_method = SampleMethod.EULER;
                foreach (var want in loraFile == null ? new[] { golden } : new[] { golden, after })
                {
                    bool withLora = loraFile != null && want == golden;
                    ip.loras = withLora ? pinned.AddrOfPinnedObject() : IntPtr.Zero;
                    ip.lora_count = withLora ? 1u : 0u;
                    IntPtr images;
                    int count;
                    bool ok = Native.generate_image(ctx, ref ip, out images, out count);
                    var headers = new List<sd_image_t>();
                    var got = Sd.TakeImages(images, count, headers);
                    check("generate_image(" + file + (withLora ? ", " + lora : "") + ")", ok && got.Count == 1, "ok=" + ok + " count=" + count);
                    if (got.Count != 1) return true;
                    var parts = want.Split('/');
                    CheckGolden(check, Path.Combine(repoRoot, "tests", "fixtures", "golden", parts[0]), parts[1] + "_0.png", headers[0], got[0]);
                }
            }
        }
        finally
        {
            pinned.Free();
            Sd.FreeString(modelPath);
            Sd.FreeString(prompt);
            if (loraPath != IntPtr.Zero) Sd.FreeString(loraPath);
        }
        return true;
    }

    // A DiT family held as separate files (the diffusion model, its text encoder, its VAE):
    // golden case `golden` ("folder/case"), "a lovely cat", 64x64, seed 42, CFG 1, the
    // default sampler. `parts` pairs an sd_ctx_params_t path field with a fixture file.
    static void RenderComponents(Action<string, bool, string> check, string repoRoot, string golden, int steps, string make, params Tuple<string, string>[] parts)
    {
        foreach (var part in parts)
        {
            if (!File.Exists(Path.Combine(FixtureCache(), part.Item2)))
            {
                Console.Error.WriteLine("skipped " + golden + ": " + part.Item2 + " is missing (scripts/fixtures.sh " + make + " writes it)");
                return;
            }
        }
        var paths = new IntPtr[parts.Length];
        for (int i = 0; i < parts.Length; i++) paths[i] = Sd.AllocString(Path.Combine(FixtureCache(), parts[i].Item2));
        IntPtr prompt = Sd.AllocString("a lovely cat");
        try
        {
            var p = new sd_ctx_params_t();
            Native.sd_ctx_params_init(ref p);
            p.n_threads = 2;
            for (int i = 0; i < parts.Length; i++)
            {
                switch (parts[i].Item1)
                {
                    case "diffusion_model_path": p.diffusion_model_path = paths[i]; break;
                    case "t5xxl_path": p.t5xxl_path = paths[i]; break;
                    case "llm_path": p.llm_path = paths[i]; break;
                    case "vae_path": p.vae_path = paths[i]; break;
                    default: throw new ArgumentException("no such path field: " + parts[i].Item1);
                }
            }
            using (var ctx = Native.new_sd_ctx(ref p))
            {
                check("new_sd_ctx(" + golden + " components)", !ctx.IsInvalid, "");
                if (ctx.IsInvalid) return;
                var ip = new sd_img_gen_params_t();
                Native.sd_img_gen_params_init(ref ip);
                ip.prompt = prompt;
                ip.width = 64;
                ip.height = 64;
                ip.seed = 42;
                ip.sample_params.sample_steps = steps;
                ip.sample_params.guidance.txt_cfg = 1.0f;
                IntPtr images;
                int count;
                bool ok = Native.generate_image(ctx, ref ip, out images, out count);
                var headers = new List<sd_image_t>();
                var got = Sd.TakeImages(images, count, headers);
                check("generate_image(" + golden + ")", ok && got.Count == 1, "ok=" + ok + " count=" + count);
                var where = golden.Split('/');
                if (got.Count == 1)
                    CheckGolden(check, Path.Combine(repoRoot, "tests", "fixtures", "golden", where[0]), where[1] + "_0.png", headers[0], got[0]);
            }
        }
        finally
        {
            foreach (var ptr in paths) Sd.FreeString(ptr);
            Sd.FreeString(prompt);
        }
    }

    public static void Run(Action<string, bool, string> check, string repoRoot)
    {
        var steps = new List<int>();
        Sd.SetProgressCallback((step, total, t) => { if (total == 4) steps.Add(step); });
        try
        {
            if (RenderGolden(check, repoRoot, "sd1.safetensors", "sd1/sampler_euler", false))
                check("progress after every step", string.Join(",", steps) == "0,1,2,3,4", string.Join(",", steps));
        }
        finally
        {
            Sd.SetProgressCallback(null);
        }
        // A LoRA merged in (sd1-lora/lora_1_0), then removed again on the same context.
        RenderGolden(check, repoRoot, "sd1.safetensors", "sd1-lora/lora_1_0", false, Path.Combine("loras", "lora_sd1.safetensors"), "sd1-lora/lora_none_after");
        RenderGolden(check, repoRoot, "sdxl.safetensors", "sdxl/sdxl_euler_v", true);
        RenderComponents(check, repoRoot, "flux/flux_defaults", 3, "flux t5xxl-tiny vae16",
            Tuple.Create("diffusion_model_path", "flux.safetensors"), Tuple.Create("t5xxl_path", "t5xxl_tiny.safetensors"), Tuple.Create("vae_path", "vae16.safetensors"));
        RenderComponents(check, repoRoot, "zimage/zimage_cfg1", 4, "z-image qwen3-tiny zimage-vae",
            Tuple.Create("diffusion_model_path", "z_image.safetensors"), Tuple.Create("llm_path", "qwen3_tiny.safetensors"), Tuple.Create("vae_path", "zimage_vae.safetensors"));
    }
}
