// An application using the packaged bindings the way a consumer does: compiled against the
// package's StableDiffusion.dll alone, run from a folder holding the package's files, with no
// library path set (bindings/csharp/run.sh builds and runs it after pack.sh). Prints
// "consumer ok" and exits 0 when every call works.
using System;
using StableDiffusion;

static class Consumer
{
    static int Main()
    {
        string version = Sd.Version();
        string devices = Sd.ListDevices();
        var p = new sd_ctx_params_t();
        Native.sd_ctx_params_init(ref p);
        string[] methods = Sd.ExportedArray("sample_method_to_str", 1);
        bool ok = version.Length > 0 && devices.StartsWith("CPU\t") && p.n_threads != 0 && methods[0] == "euler";
        Console.WriteLine("consumer " + (ok ? "ok" : "FAILED") + ": version " + version + ", library " + Sd.LibraryPath);
        return ok ? 0 : 1;
    }
}
