// Checks the C# bindings against the library: struct layouts against the ABI manifest
// (Expected.g.cs), defaults, names, device listing, callbacks and failure paths.
// Built with mcs and run under mono by bindings/csharp/run.sh. Ends with "N passed, N failed".
using System;
using System.Collections.Generic;
using System.IO;
using System.Runtime.InteropServices;
using StableDiffusion;

static class Program
{
    static int passed, failed;

    static void Check(string what, bool ok, string detail = "")
    {
        if (ok) { passed++; return; }
        failed++;
        Console.Error.WriteLine("FAIL " + what + (detail.Length > 0 ? ": " + detail : ""));
    }

    static void Run(string name, Action test)
    {
        try { test(); }
        catch (Exception e) { Check(name, false, e.GetType().Name + ": " + e.Message); }
    }

    static void Layouts()
    {
        foreach (var l in Expected.Layouts)
        {
            Check("sizeof " + l.Item1.Name, Marshal.SizeOf(l.Item1) == l.Item2, Marshal.SizeOf(l.Item1) + " != " + l.Item2);
            var fields = l.Item1.GetFields();
            Check("field count " + l.Item1.Name, fields.Length == l.Item3.Length);
            for (int i = 0; i < l.Item3.Length; i++)
            {
                var f = l.Item3[i];
                Check("field order " + l.Item1.Name + "." + f.Item1, i < fields.Length && fields[i].Name == f.Item1);
                int off = Marshal.OffsetOf(l.Item1, f.Item1).ToInt32();
                Check("offset " + l.Item1.Name + "." + f.Item1, off == f.Item2, off + " != " + f.Item2);
            }
        }
    }

    static void Facts()
    {
        Check("sd_version", !string.IsNullOrEmpty(Sd.Version()));
        Check("sd_commit", !string.IsNullOrEmpty(Sd.Commit()));
        Check("system info", Sd.SystemInfo() != null && Sd.SystemInfo().StartsWith("System Info:"), Sd.SystemInfo());
        Check("physical cores", Native.sd_get_num_physical_cores() >= 1);
    }

    static void Devices()
    {
        ulong need = Native.sd_list_devices(null, UIntPtr.Zero).ToUInt64();
        Check("list devices size", need > 0);
        var small = new byte[5];
        for (int i = 0; i < small.Length; i++) small[i] = (byte)'x';
        Check("list devices short", Native.sd_list_devices(small, new UIntPtr(5)).ToUInt64() == need);
        Check("short buffer NUL-terminated", small[Math.Min(4, (int)need)] == 0);
        string all = Sd.ListDevices();
        Check("list devices text", all.Length == (int)need && all.EndsWith("\n"), all);
        Check("CPU device listed", all.StartsWith("CPU\t") || all.Contains("\nCPU\t"), all);
    }

    // The name and parse functions by C name, over raw enum values.
    static readonly Dictionary<string, Func<uint, IntPtr>> NameFns = new Dictionary<string, Func<uint, IntPtr>>
    {
        { "sd_type_name", v => Native.sd_type_name((SDType)v) },
        { "sd_rng_type_name", v => Native.sd_rng_type_name((RngType)v) },
        { "sd_sample_method_name", v => Native.sd_sample_method_name((SampleMethod)v) },
        { "sd_scheduler_name", v => Native.sd_scheduler_name((Scheduler)v) },
        { "sd_prediction_name", v => Native.sd_prediction_name((Prediction)v) },
        { "sd_preview_name", v => Native.sd_preview_name((Preview)v) },
        { "sd_lora_apply_mode_name", v => Native.sd_lora_apply_mode_name((LoraApplyMode)v) },
        { "sd_hires_upscaler_name", v => Native.sd_hires_upscaler_name((HiresUpscaler)v) },
    };
    static readonly Dictionary<string, Func<string, uint>> ParseFns = new Dictionary<string, Func<string, uint>>
    {
        { "str_to_sd_type", t => (uint)Native.str_to_sd_type(t) },
        { "str_to_rng_type", t => (uint)Native.str_to_rng_type(t) },
        { "str_to_sample_method", t => (uint)Native.str_to_sample_method(t) },
        { "str_to_scheduler", t => (uint)Native.str_to_scheduler(t) },
        { "str_to_prediction", t => (uint)Native.str_to_prediction(t) },
        { "str_to_preview", t => (uint)Native.str_to_preview(t) },
        { "str_to_lora_apply_mode", t => (uint)Native.str_to_lora_apply_mode(t) },
        { "str_to_sd_hires_upscaler", t => (uint)Native.str_to_sd_hires_upscaler(t) },
    };

    static void Names()
    {
        foreach (var n in Expected.Names)
        {
            string got = Sd.PtrToString(NameFns[n.Item1](n.Item2));
            Check(n.Item1 + "(" + n.Item2 + ")", got == n.Item3, got + " != " + n.Item3);
        }
        foreach (var n in Expected.Parses)
        {
            uint got = ParseFns[n.Item1](n.Item2);
            Check(n.Item1 + "(\"" + n.Item2 + "\")", got == n.Item3, got + " != " + n.Item3);
        }
        var methods = Sd.ExportedArray("sample_method_to_str", Expected.sample_method_to_str.Length);
        var schedulers = Sd.ExportedArray("scheduler_to_str", Expected.scheduler_to_str.Length);
        Check("sample_method_to_str", string.Join(",", methods) == string.Join(",", Expected.sample_method_to_str), string.Join(",", methods));
        Check("scheduler_to_str", string.Join(",", schedulers) == string.Join(",", Expected.scheduler_to_str), string.Join(",", schedulers));
    }

    static void ParamsToStr()
    {
        var p = new sd_ctx_params_t();
        Native.sd_ctx_params_init(ref p);
        IntPtr model = Sd.AllocString("model.safetensors");
        try
        {
            p.model_path = model;
            string s = Sd.TakeString(Native.sd_ctx_params_to_str(ref p));
            Check("sd_ctx_params_to_str", s != null && s.Contains("model.safetensors"), s ?? "NULL");
        }
        finally { Sd.FreeString(model); }
        var sp = new sd_sample_params_t();
        Native.sd_sample_params_init(ref sp);
        Check("sd_sample_params_to_str", !string.IsNullOrEmpty(Sd.TakeString(Native.sd_sample_params_to_str(ref sp))));
        var ip = new sd_img_gen_params_t();
        Native.sd_img_gen_params_init(ref ip);
        IntPtr prompt = Sd.AllocString("a lovely cat");
        try
        {
            ip.prompt = prompt;
            string s = Sd.TakeString(Native.sd_img_gen_params_to_str(ref ip));
            Check("sd_img_gen_params_to_str", s != null && s.Contains("a lovely cat"), s ?? "NULL");
        }
        finally { Sd.FreeString(prompt); }
    }

    static void Callbacks()
    {
        var messages = new List<string>();
        bool sawError = false;
        Sd.SetLogCallback((level, text) => { messages.Add(text); if (level == LogLevel.ERROR) sawError = true; });
        Sd.SetProgressCallback((step, steps, t) => { });
        Sd.SetPreviewCallback((step, n, frames, noisy) => { }, Preview.PROJ, 1, true, false);
        Sd.SetBackendEvalCallback((t, ask, data) => true);
        GC.Collect();
        GC.WaitForPendingFinalizers();  // the registered delegates must survive this

        var p = new sd_ctx_params_t();
        Native.sd_ctx_params_init(ref p);
        p.n_threads = 1;
        IntPtr model = Sd.AllocString(Path.Combine(Path.GetTempPath(), "no-such-model-" + Guid.NewGuid() + ".safetensors"));
        try
        {
            p.model_path = model;
            using (var ctx = Native.new_sd_ctx(ref p))
                Check("new_sd_ctx(missing model) fails", ctx.IsInvalid);
        }
        finally { Sd.FreeString(model); }
        Check("log callback received messages", messages.Count > 0);
        Check("log callback received an error", sawError);

        Sd.SetProgressCallback(null);
        Sd.SetPreviewCallback(null, Preview.NONE, 1, false, false);
        Sd.SetBackendEvalCallback(null);
        Sd.SetLogCallback(null);
    }

    static void Failures()
    {
        var none = new SdContextHandle();  // a NULL sd_ctx_t*
        Check("supports image generation (NULL)", !Native.sd_ctx_supports_image_generation(none));
        Check("supports video generation (NULL)", !Native.sd_ctx_supports_video_generation(none));
        Check("has control net (NULL)", !Native.sd_ctx_has_control_net(none));
        Check("default sample method (NULL)", Native.sd_get_default_sample_method(none) == SampleMethod.EULER_A);
        Check("default scheduler (NULL, lcm)", Native.sd_get_default_scheduler(none, SampleMethod.LCM) == Scheduler.LCM);
        var ip = new sd_img_gen_params_t();
        Native.sd_img_gen_params_init(ref ip);
        IntPtr images;
        int count;
        Check("generate_image(NULL)", !Native.generate_image(none, ref ip, out images, out count));
        Check("generate_image outputs cleared", images == IntPtr.Zero && count == 0);
        Native.sd_cancel_generation(none, CancelMode.ALL);

        using (var up = Native.new_upscaler_ctx("/nonexistent/esrgan.safetensors", false, 1, 128, null, null))
            Check("new_upscaler_ctx(missing)", up.IsInvalid);
        Check("get_upscale_factor(NULL)", Native.get_upscale_factor(new UpscalerHandle()) == 1);
        using (var ad = Native.new_adetailer_ctx("/nonexistent/detector.safetensors", 1, null, null))
            Check("new_adetailer_ctx(missing)", ad.IsInvalid);
        Check("convert(missing)", !Native.convert("/nonexistent/model.safetensors", null, Path.Combine(Path.GetTempPath(), "never.gguf"), SDType.F16, null, false));
        Check("load_imatrix(missing)", !Native.load_imatrix("/nonexistent/imatrix.dat"));

        // free_sd_images takes malloc'ed images
        int size = Marshal.SizeOf(typeof(sd_image_t));
        IntPtr arr = Native.libc_malloc(new UIntPtr((ulong)(2 * size)));
        for (int i = 0; i < 2; i++)
        {
            var img = new sd_image_t { width = 2, height = 2, channel = 3, data = Native.libc_malloc(new UIntPtr(12)) };
            Marshal.StructureToPtr(img, new IntPtr(arr.ToInt64() + i * size), false);
        }
        Native.free_sd_images(arr, 2);
        Native.free_sd_images(IntPtr.Zero, 0);
    }

    static void Canny()
    {
        const int W = 32, H = 24, C = 3;
        IntPtr px = Marshal.AllocHGlobal(W * H * C);
        try
        {
            var bytes = new byte[W * H * C];
            for (int y = 0; y < H; y++)
                for (int x = 0; x < W; x++)
                    for (int c = 0; c < C; c++)
                        bytes[(y * W + x) * C + c] = (byte)(x >= 8 && x < 24 && y >= 6 && y < 18 ? 255 : 0);
            Marshal.Copy(bytes, 0, px, bytes.Length);
            var img = new sd_image_t { width = W, height = H, channel = C, data = px };
            Check("preprocess_canny", Native.preprocess_canny(img, 0.08f, 0.08f, 0.8f, 1.0f, false));
            Marshal.Copy(px, bytes, 0, bytes.Length);
            int edges = 0;
            bool binary = true;
            foreach (var b in bytes) { if (b == 255) edges++; if (b != 0 && b != 255) binary = false; }
            Check("canny edges", edges > 0 && binary, edges + " edge bytes");
        }
        finally { Marshal.FreeHGlobal(px); }
    }

    static int Main(string[] args)
    {
        if (args.Length > 0) Sd.LibraryPath = args[0];
        Run("layouts", Layouts);
        Run("defaults", () => Expected.CheckDefaults((what, ok, got) => Check(what, ok, got)));
        Run("facts", Facts);
        Run("devices", Devices);
        Run("names", Names);
        Run("to_str", ParamsToStr);
        Run("callbacks", Callbacks);
        Run("failures", Failures);
        Run("canny", Canny);
        Run("generate", () => GenerateTests.Run((what, ok, got) => Check(what, ok, got),
            Path.GetFullPath(Path.Combine(AppDomain.CurrentDomain.BaseDirectory, "..", "..", ".."))));
        Run("upscale", () => UpscaleTests.Run((what, ok, got) => Check(what, ok, got),
            Path.GetFullPath(Path.Combine(AppDomain.CurrentDomain.BaseDirectory, "..", "..", ".."))));
        Run("video", () => VideoTests.Run((what, ok, got) => Check(what, ok, got),
            Path.GetFullPath(Path.Combine(AppDomain.CurrentDomain.BaseDirectory, "..", "..", ".."))));
        Console.WriteLine(passed + " passed, " + failed + " failed");
        return failed == 0 ? 0 : 1;
    }
}
