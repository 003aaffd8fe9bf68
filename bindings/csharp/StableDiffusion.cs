// Hand-written part of the C# bindings: handles that free their native object, string
// marshalling, and callbacks kept alive while the library holds them.
// NativeMethods.g.cs (generated) declares the enums, structs, delegates and functions.
using System;
using System.Collections.Generic;
using System.Runtime.InteropServices;
using System.Text;
using Microsoft.Win32.SafeHandles;

namespace StableDiffusion
{
    /// <summary>An sd_ctx_t*; disposing it calls free_sd_ctx.</summary>
    public sealed class SdContextHandle : SafeHandleZeroOrMinusOneIsInvalid
    {
        public SdContextHandle() : base(true) { }
        protected override bool ReleaseHandle() { Native.free_sd_ctx(handle); return true; }
    }

    /// <summary>An upscaler_ctx_t*; disposing it calls free_upscaler_ctx.</summary>
    public sealed class UpscalerHandle : SafeHandleZeroOrMinusOneIsInvalid
    {
        public UpscalerHandle() : base(true) { }
        protected override bool ReleaseHandle() { Native.free_upscaler_ctx(handle); return true; }
    }

    /// <summary>An adetailer_ctx_t*; disposing it calls free_adetailer_ctx.</summary>
    public sealed class AdetailerHandle : SafeHandleZeroOrMinusOneIsInvalid
    {
        public AdetailerHandle() : base(true) { }
        protected override bool ReleaseHandle() { Native.free_adetailer_ctx(handle); return true; }
    }

    public static partial class Native
    {
        // The C library's allocator: *_to_str results are freed with free(); images handed to
        // free_sd_images must come from malloc().
        [DllImport("libc", CallingConvention = CallingConvention.Cdecl, EntryPoint = "free")]
        public static extern void libc_free(IntPtr p);

        [DllImport("libc", CallingConvention = CallingConvention.Cdecl, EntryPoint = "malloc")]
        public static extern IntPtr libc_malloc(UIntPtr size);
    }

    /// <summary>An 8-bit picture: Data holds Height*Width*Channel bytes, row by row, channels interleaved.</summary>
    public sealed class SdImage
    {
        public readonly int Width, Height, Channel;
        public readonly byte[] Data;

        public SdImage(int width, int height, int channel, byte[] data)
        {
            if (width < 0 || height < 0 || channel < 0 || data == null || data.LongLength != (long)width * height * channel)
                throw new ArgumentException(width + "x" + height + "x" + channel + " image needs " + ((long)width * height * channel) +
                                            " bytes, got " + (data == null ? "null" : data.LongLength.ToString()));
            Width = width; Height = height; Channel = channel; Data = data;
        }
    }

    /// <summary>Sound: Samples holds SampleCount*Channels values in [-1, 1], channels interleaved.</summary>
    public sealed class SdAudio
    {
        public readonly uint SampleRate, Channels;
        public readonly float[] Samples;

        public SdAudio(uint sampleRate, uint channels, float[] samples)
        {
            if (channels == 0 || samples == null || samples.Length % channels != 0)
                throw new ArgumentException("samples must be whole frames of " + channels + " channels");
            SampleRate = sampleRate; Channels = channels; Samples = samples;
        }

        public ulong SampleCount { get { return (ulong)Samples.Length / Channels; } }
    }

    /// <summary>A LoRA file applied to the request (IsHighNoise: to the high-noise model of a Wan2.2 pair).</summary>
    public sealed class SdLora
    {
        public string Path;
        public float Multiplier = 1.0f;
        public bool IsHighNoise;
    }

    /// <summary>A reference video: frames at Fps, optional soundtrack.</summary>
    public sealed class SdRefVideo
    {
        public List<SdImage> Frames = new List<SdImage>();
        public int Fps = 24;
        public SdAudio Audio;
    }

    /// <summary>The array and string parts of an sd_sample_params_t (its value fields live in the struct).</summary>
    public sealed class SampleArrays
    {
        /// <summary>Layers skipped by skip-layer guidance (null: none).</summary>
        public int[] SkipLayers;
        /// <summary>Sigmas replacing the scheduler's (null: the scheduler's).</summary>
        public float[] CustomSigmas;
        public string ExtraArgs;
    }

    /// <summary>
    /// A generate_video request. Params holds every value field, initialised by
    /// sd_vid_gen_params_init (set e.g. Params.width, Params.video_frames,
    /// Params.sample_params.sample_steps, Params.high_noise_sample_params.guidance.txt_cfg,
    /// Params.moe_boundary, Params.vace_strength, Params.cache.mode,
    /// Params.vae_tiling_params.enabled); the properties hold what the struct points to, which
    /// GenerateVideo copies to unmanaged memory for the call.
    /// </summary>
    public sealed class VideoRequest
    {
        public sd_vid_gen_params_t Params;
        public string Prompt = "";
        public string NegativePrompt = "";
        /// <summary>The first frame (image to video); null: none.</summary>
        public SdImage InitImage;
        /// <summary>The last frame (first-last-frame to video); null: none.</summary>
        public SdImage EndImage;
        public List<SdImage> RefImages = new List<SdImage>();
        /// <summary>Control video frames (Wan VACE).</summary>
        public List<SdImage> ControlFrames = new List<SdImage>();
        public List<SdRefVideo> RefVideos = new List<SdRefVideo>();
        public List<SdAudio> RefAudios = new List<SdAudio>();
        public List<SdLora> Loras = new List<SdLora>();
        public SampleArrays Sample = new SampleArrays();
        public SampleArrays HighNoiseSample = new SampleArrays();
        public string ExtraTilingArgs;
        /// <summary>cache-dit step mask (Params.cache.scm_mask).</summary>
        public string ScmMask;
        public string HiresModelPath;
        public float[] HiresCustomSigmas;

        public VideoRequest() { Native.sd_vid_gen_params_init(ref Params); }
    }

    /// <summary>What generate_video returns: the frames and the sound (null for models without one).</summary>
    public sealed class VideoResult
    {
        public List<SdImage> Frames = new List<SdImage>();
        public SdAudio Audio;
    }

    /// <summary>A call the library answered with failure (its log callback received the reasons).</summary>
    public sealed class SdException : Exception
    {
        public SdException(string message) : base(message) { }
    }

    /// <summary>Unmanaged copies of request data, all freed together on Dispose.</summary>
    public sealed class NativeArena : IDisposable
    {
        readonly List<IntPtr> blocks = new List<IntPtr>();

        IntPtr Alloc(long bytes)
        {
            IntPtr p = Marshal.AllocHGlobal(new IntPtr(Math.Max(bytes, 1)));
            blocks.Add(p);
            return p;
        }

        /// <summary>A NUL-terminated UTF-8 copy (null gives NULL).</summary>
        public IntPtr String(string s)
        {
            if (s == null) return IntPtr.Zero;
            var bytes = Encoding.UTF8.GetBytes(s);
            IntPtr p = Alloc(bytes.Length + 1);
            Marshal.Copy(bytes, 0, p, bytes.Length);
            Marshal.WriteByte(p, bytes.Length, 0);
            return p;
        }

        public sd_image_t Image(SdImage img)
        {
            if (img == null) return new sd_image_t();
            IntPtr data = Alloc(img.Data.LongLength);
            Marshal.Copy(img.Data, 0, data, img.Data.Length);
            return new sd_image_t { width = (uint)img.Width, height = (uint)img.Height, channel = (uint)img.Channel, data = data };
        }

        public sd_audio_t Audio(SdAudio audio)
        {
            if (audio == null) return new sd_audio_t();
            return new sd_audio_t { sample_rate = audio.SampleRate, channels = audio.Channels, sample_count = audio.SampleCount, data = Floats(audio.Samples) };
        }

        /// <summary>A C array of structs (NULL when empty).</summary>
        public IntPtr Array<T>(IList<T> items) where T : struct
        {
            if (items == null || items.Count == 0) return IntPtr.Zero;
            int size = Marshal.SizeOf(typeof(T));
            IntPtr p = Alloc((long)size * items.Count);
            for (int i = 0; i < items.Count; i++) Marshal.StructureToPtr(items[i], new IntPtr(p.ToInt64() + (long)i * size), false);
            return p;
        }

        public IntPtr Images(IList<SdImage> images)
        {
            var c = new List<sd_image_t>();
            if (images != null) foreach (var img in images) c.Add(Image(img));
            return Array(c);
        }

        public IntPtr Floats(float[] values)
        {
            if (values == null || values.Length == 0) return IntPtr.Zero;
            IntPtr p = Alloc(4L * values.Length);
            Marshal.Copy(values, 0, p, values.Length);
            return p;
        }

        public IntPtr Ints(int[] values)
        {
            if (values == null || values.Length == 0) return IntPtr.Zero;
            IntPtr p = Alloc(4L * values.Length);
            Marshal.Copy(values, 0, p, values.Length);
            return p;
        }

        /// <summary>Points the struct's arrays and strings at copies of `a`.</summary>
        public void Sample(ref sd_sample_params_t sp, SampleArrays a)
        {
            if (a == null) return;
            sp.guidance.slg.layers = Ints(a.SkipLayers);
            sp.guidance.slg.layer_count = new UIntPtr((uint)(a.SkipLayers == null ? 0 : a.SkipLayers.Length));
            sp.custom_sigmas = Floats(a.CustomSigmas);
            sp.custom_sigmas_count = a.CustomSigmas == null ? 0 : a.CustomSigmas.Length;
            sp.extra_sample_args = String(a.ExtraArgs);
        }

        public void Dispose()
        {
            foreach (var p in blocks) Marshal.FreeHGlobal(p);
            blocks.Clear();
        }
    }

    /// <summary>Helpers over the raw API.</summary>
    public static class Sd
    {
        /// <summary>A NUL-terminated UTF-8 string the library owns (NULL gives null).</summary>
        public static string PtrToString(IntPtr p)
        {
            if (p == IntPtr.Zero) return null;
            int n = 0;
            while (Marshal.ReadByte(p, n) != 0) n++;
            var bytes = new byte[n];
            Marshal.Copy(p, bytes, 0, n);
            return Encoding.UTF8.GetString(bytes);
        }

        /// <summary>A malloc'ed string from a *_to_str function: copied, then freed.</summary>
        public static string TakeString(IntPtr p)
        {
            try { return PtrToString(p); }
            finally { if (p != IntPtr.Zero) Native.libc_free(p); }
        }

        /// <summary>
        /// A UTF-8 copy of s in unmanaged memory for a const char* struct field; free it with
        /// FreeString once the struct is no longer used.
        /// </summary>
        public static IntPtr AllocString(string s)
        {
            if (s == null) return IntPtr.Zero;
            var bytes = Encoding.UTF8.GetBytes(s);
            IntPtr p = Marshal.AllocHGlobal(bytes.Length + 1);
            Marshal.Copy(bytes, 0, p, bytes.Length);
            Marshal.WriteByte(p, bytes.Length, 0);
            return p;
        }

        public static void FreeString(IntPtr p)
        {
            if (p != IntPtr.Zero) Marshal.FreeHGlobal(p);
        }

        public static string Version() { return PtrToString(Native.sd_version()); }
        public static string Commit() { return PtrToString(Native.sd_commit()); }
        public static string SystemInfo() { return PtrToString(Native.sd_get_system_info()); }

        /// <summary>The device listing: one "name\tdescription" per line.</summary>
        public static string ListDevices()
        {
            ulong need = Native.sd_list_devices(null, UIntPtr.Zero).ToUInt64();
            var buf = new byte[need + 1];
            Native.sd_list_devices(buf, new UIntPtr((ulong)buf.Length));
            return Encoding.UTF8.GetString(buf, 0, (int)need);
        }

        /// <summary>An exported `const char* name[]` with `count` entries.</summary>
        public static string[] ExportedArray(string name, int count)
        {
            IntPtr lib = dlopen(LibraryPath, RTLD_NOW);
            if (lib == IntPtr.Zero) throw new DllNotFoundException(LibraryPath);
            IntPtr arr = dlsym(lib, name);
            if (arr == IntPtr.Zero) throw new EntryPointNotFoundException(name);
            var result = new string[count];
            for (int i = 0; i < count; i++) result[i] = PtrToString(Marshal.ReadIntPtr(arr, i * IntPtr.Size));
            return result;
        }

        /// <summary>The library file dlopen loads for the exported arrays: the one beside this
        /// assembly when there is one (a packaged application), else the loader's search.</summary>
        public static string LibraryPath = DefaultLibraryPath();

        static string DefaultLibraryPath()
        {
            const string name = "libstable-diffusion.so";
            try
            {
                string dir = System.IO.Path.GetDirectoryName(typeof(Sd).Assembly.Location);
                string beside = string.IsNullOrEmpty(dir) ? null : System.IO.Path.Combine(dir, name);
                return beside != null && System.IO.File.Exists(beside) ? beside : name;
            }
            catch (Exception) { return name; }
        }

        const int RTLD_NOW = 2;
        [DllImport("libdl.so.2")] static extern IntPtr dlopen(string file, int mode);
        [DllImport("libdl.so.2")] static extern IntPtr dlsym(IntPtr handle, string name);

        /// <summary>Copies a library-allocated image array and frees it with free_sd_images.</summary>
        public static List<byte[]> TakeImages(IntPtr images, int count, List<sd_image_t> headers = null)
        {
            var result = new List<byte[]>();
            if (images == IntPtr.Zero) return result;
            try
            {
                int size = Marshal.SizeOf(typeof(sd_image_t));
                for (int i = 0; i < count; i++)
                {
                    var img = (sd_image_t)Marshal.PtrToStructure(new IntPtr(images.ToInt64() + i * size), typeof(sd_image_t));
                    var data = new byte[(long)img.width * img.height * img.channel];
                    if (img.data != IntPtr.Zero && data.Length > 0) Marshal.Copy(img.data, data, 0, data.Length);
                    result.Add(data);
                    if (headers != null) headers.Add(img);
                }
            }
            finally { Native.free_sd_images(images, count); }
            return result;
        }

        /// <summary>Copies a library-allocated image array into SdImages and frees it with free_sd_images.</summary>
        public static List<SdImage> TakeSdImages(IntPtr images, int count)
        {
            var headers = new List<sd_image_t>();
            var data = TakeImages(images, count, headers);
            var result = new List<SdImage>();
            for (int i = 0; i < data.Count; i++)
                result.Add(new SdImage((int)headers[i].width, (int)headers[i].height, (int)headers[i].channel, data[i]));
            return result;
        }

        /// <summary>Copies a library-allocated sd_audio_t and frees it with free_sd_audio (NULL gives null).</summary>
        public static SdAudio TakeAudio(IntPtr audio)
        {
            if (audio == IntPtr.Zero) return null;
            try
            {
                var a = (sd_audio_t)Marshal.PtrToStructure(audio, typeof(sd_audio_t));
                if (a.data == IntPtr.Zero || a.channels == 0) return null;
                var samples = new float[checked((long)(a.sample_count * a.channels))];
                Marshal.Copy(a.data, samples, 0, samples.Length);
                return new SdAudio(a.sample_rate, a.channels, samples);
            }
            finally { Native.free_sd_audio(audio); }
        }

        /// <summary>
        /// The request's sd_vid_gen_params_t with every pointer set to a copy in `arena`
        /// (valid until the arena is disposed).
        /// </summary>
        public static sd_vid_gen_params_t ToNative(VideoRequest r, NativeArena arena)
        {
            var p = r.Params;
            p.prompt = arena.String(r.Prompt ?? "");
            p.negative_prompt = arena.String(r.NegativePrompt ?? "");
            p.init_image = arena.Image(r.InitImage);
            p.end_image = arena.Image(r.EndImage);
            p.ref_images = arena.Images(r.RefImages);
            p.ref_images_count = r.RefImages == null ? 0 : r.RefImages.Count;
            p.control_frames = arena.Images(r.ControlFrames);
            p.control_frames_size = r.ControlFrames == null ? 0 : r.ControlFrames.Count;
            var videos = new List<sd_ref_video_t>();
            if (r.RefVideos != null)
                foreach (var v in r.RefVideos)
                    videos.Add(new sd_ref_video_t { frames = arena.Images(v.Frames), frame_count = v.Frames == null ? 0 : v.Frames.Count, fps = v.Fps, audio = arena.Audio(v.Audio) });
            p.ref_videos = arena.Array(videos);
            p.ref_videos_count = videos.Count;
            var audios = new List<sd_audio_t>();
            if (r.RefAudios != null) foreach (var a in r.RefAudios) audios.Add(arena.Audio(a));
            p.ref_audios = arena.Array(audios);
            p.ref_audios_count = audios.Count;
            var loras = new List<sd_lora_t>();
            if (r.Loras != null)
                foreach (var l in r.Loras) loras.Add(new sd_lora_t { is_high_noise = l.IsHighNoise, multiplier = l.Multiplier, path = arena.String(l.Path) });
            p.loras = arena.Array(loras);
            p.lora_count = (uint)loras.Count;
            arena.Sample(ref p.sample_params, r.Sample);
            arena.Sample(ref p.high_noise_sample_params, r.HighNoiseSample);
            p.vae_tiling_params.extra_tiling_args = arena.String(r.ExtraTilingArgs);
            p.cache.scm_mask = arena.String(r.ScmMask);
            p.hires.model_path = arena.String(r.HiresModelPath);
            p.hires.custom_sigmas = arena.Floats(r.HiresCustomSigmas);
            p.hires.custom_sigmas_count = r.HiresCustomSigmas == null ? 0 : r.HiresCustomSigmas.Length;
            return p;
        }

        /// <summary>
        /// Generates a video (Wan 2.x: text, image or first-last frame to video, VACE, MoE
        /// pairs). Throws SdException when the library fails; the frames and sound it returns
        /// are copied and freed in the library.
        /// </summary>
        public static VideoResult GenerateVideo(SdContextHandle ctx, VideoRequest request)
        {
            using (var arena = new NativeArena())
            {
                var p = ToNative(request, arena);
                IntPtr frames, audio;
                int count;
                bool ok = Native.generate_video(ctx, ref p, out frames, out count, out audio);
                var result = new VideoResult { Frames = TakeSdImages(frames, count), Audio = TakeAudio(audio) };
                if (!ok) throw new SdException("generate_video failed");
                return result;
            }
        }

        // Delegates the library holds: a collected delegate would leave it calling freed code.
#pragma warning disable 414  // assigned, never read: they exist to be reachable
        static sd_log_cb_t logCallback;
        static sd_progress_cb_t progressCallback;
        static sd_preview_cb_t previewCallback;
        static sd_graph_eval_callback_t evalCallback;
#pragma warning restore 414

        /// <summary>Sends log messages to `log(level, text)`; null stops.</summary>
        public static void SetLogCallback(Action<LogLevel, string> log)
        {
            sd_log_cb_t cb = null;
            if (log != null) cb = (level, text, data) => { try { log(level, PtrToString(text)); } catch (Exception) { } };
            Native.sd_set_log_callback(cb, IntPtr.Zero);
            logCallback = cb;
        }

        /// <summary>Calls `progress(step, steps, seconds)` after each step; null stops.</summary>
        public static void SetProgressCallback(Action<int, int, float> progress)
        {
            sd_progress_cb_t cb = null;
            if (progress != null) cb = (step, steps, time, data) => { try { progress(step, steps, time); } catch (Exception) { } };
            Native.sd_set_progress_callback(cb, IntPtr.Zero);
            progressCallback = cb;
        }

        /// <summary>Calls `preview(step, frameCount, frames, isNoisy)`; null stops.</summary>
        public static void SetPreviewCallback(Action<int, int, IntPtr, bool> preview, Preview mode, int interval, bool denoised, bool noisy)
        {
            sd_preview_cb_t cb = null;
            if (preview != null) cb = (step, n, frames, isNoisy, data) => { try { preview(step, n, frames, isNoisy); } catch (Exception) { } };
            Native.sd_set_preview_callback(cb, preview != null ? mode : Preview.NONE, interval, denoised, noisy, IntPtr.Zero);
            previewCallback = cb;
        }

        /// <summary>Raw ggml graph evaluation callback; null stops.</summary>
        public static void SetBackendEvalCallback(sd_graph_eval_callback_t cb)
        {
            Native.sd_set_backend_eval_callback(cb, IntPtr.Zero);
            evalCallback = cb;
        }
    }
}
