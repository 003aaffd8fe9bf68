// ESRGAN upscaling through the C# bindings: the synthetic ESRGAN x4 model must give the
// reference's golden picture for case esrgan/upscale_init_64 (tests/fixtures/golden/esrgan).
// The model comes from the fixture cache ($SD_FIXTURE_CACHE, default
// ~/.cache/sd-rs-fixtures), where scripts/test.sh writes it with scripts/fixtures.sh.
using System;
using System.IO;
using System.Collections.Generic;
using System.Runtime.InteropServices;
using StableDiffusion;

static class UpscaleTests
{
    public static void Run(Action<string, bool, string> check, string repoRoot)
    {
        string cache = Environment.GetEnvironmentVariable("SD_FIXTURE_CACHE");
        if (string.IsNullOrEmpty(cache))
            cache = Path.Combine(Environment.GetEnvironmentVariable("HOME") ?? ".", ".cache", "sd-rs-fixtures");
        string model = Path.Combine(cache, "esrgan_x4.safetensors");
        if (!File.Exists(model))
        {
            Console.Error.WriteLine("skipped upscale: " + model + " is missing (scripts/fixtures.sh esrgan_x4.safetensors writes it)");
            return;
        }
        var input = GenerateTests.ReadPng(Path.Combine(repoRoot, "tests", "fixtures", "inputs", "init_64.png"));
        IntPtr px = Marshal.AllocHGlobal(input.Item4.Length);
        try
        {
            Marshal.Copy(input.Item4, 0, px, input.Item4.Length);
            using (var up = Native.new_upscaler_ctx(model, false, 2, 128, null, null))
            {
                check("new_upscaler_ctx(esrgan_x4)", !up.IsInvalid, "");
                if (up.IsInvalid) return;
                check("get_upscale_factor", Native.get_upscale_factor(up) == 4, Native.get_upscale_factor(up).ToString());
                var img = new sd_image_t { width = (uint)input.Item1, height = (uint)input.Item2, channel = (uint)input.Item3, data = px };
                IntPtr images;
                int count;
                bool ok = Native.upscale(up, img, 4, out images, out count);
                var headers = new List<sd_image_t>();
                var got = Sd.TakeImages(images, count, headers);
                check("upscale(esrgan_x4)", ok && got.Count == 1, "ok=" + ok + " count=" + count);
                if (got.Count != 1) return;
                GenerateTests.CheckGolden(check, Path.Combine(repoRoot, "tests", "fixtures", "golden", "esrgan"), "upscale_init_64_0.png", headers[0], got[0]);
            }
        }
        finally { Marshal.FreeHGlobal(px); }
    }
}
