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

        /// <summary>The library file dlopen loads for the exported arrays.</summary>
        public static string LibraryPath = "libstable-diffusion.so";

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
