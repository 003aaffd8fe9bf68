//! sd-server's command line: its own options (listen address, limits) and, for everything
//! else, sd-cli's parser, so the model and context options and the default generation
//! options (`--cfg-scale`, `--steps`, ...) are spelled exactly as for sd-cli and the
//! reference's server.

use sd_cli::args::{self, Group, Opts, Parsed};

/// What requests may ask for: past these a request is refused with a 4xx answer.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_width: i32,
    pub max_height: i32,
    /// The reference advertises 64 as the smallest side; smaller pictures are refused.
    pub min_side: i32,
    pub max_batch_count: i32,
    pub max_steps: i32,
    pub max_video_frames: i32,
    /// Jobs queued or generating, all APIs together.
    pub max_queue_size: usize,
    pub max_body_bytes: usize,
    /// Seconds a finished async job stays readable.
    pub job_ttl_seconds: i64,
}

impl Default for Limits {
    fn default() -> Self {
        // The reference's advertised limits (capabilities.limits) and queue size.
        Limits {
            max_width: 4096,
            max_height: 4096,
            min_side: 64,
            max_batch_count: 8,
            max_steps: 150,
            max_video_frames: 257,
            max_queue_size: 64,
            max_body_bytes: 64 << 20,
            job_ttl_seconds: 600,
        }
    }
}

/// The server's own options.
#[derive(Debug, Clone)]
pub struct ServerOpts {
    pub listen_ip: String,
    pub listen_port: u16,
    pub serve_html_path: String,
    pub verbose: bool,
    pub color: bool,
    pub limits: Limits,
}

impl Default for ServerOpts {
    fn default() -> Self {
        ServerOpts { listen_ip: "127.0.0.1".into(), listen_port: 1234, serve_html_path: String::new(), verbose: false, color: false, limits: Limits::default() }
    }
}

/// A parsed command line.
#[derive(Debug)]
pub enum Command {
    Serve(Box<ServerOpts>, Box<Opts>),
    Help,
    Version,
    ListDevices,
}

type Setter = fn(&mut ServerOpts, &str) -> Result<(), String>;

/// (short, long, value hint, help, setter); a switch has an empty hint.
struct ServerOpt {
    short: &'static str,
    long: &'static str,
    hint: &'static str,
    help: &'static str,
    set: Setter,
}

fn number<T: std::str::FromStr>(v: &str, what: &str) -> Result<T, String> {
    v.trim().parse::<T>().map_err(|_| format!("'{v}' is not a valid {what}"))
}

fn positive(v: &str) -> Result<i32, String> {
    let n: i32 = number(v, "integer")?;
    if n < 1 {
        return Err(format!("'{v}' must be at least 1"));
    }
    Ok(n)
}

fn server_options() -> Vec<ServerOpt> {
    let o = |short, long, hint, help, set: Setter| ServerOpt { short, long, hint, help, set };
    vec![
        o("-l", "--listen-ip", "<string>", "server listen ip (default: 127.0.0.1)", |s, v| {
            s.listen_ip = v.to_string();
            Ok(())
        }),
        o("", "--listen-port", "<int>", "server listen port, 0 for any free port (default: 1234)", |s, v| {
            s.listen_port = number(v, "port (0..65535)")?;
            Ok(())
        }),
        o("", "--serve-html-path", "<string>", "HTML file to serve at / instead of the built-in page", |s, v| {
            s.serve_html_path = v.to_string();
            Ok(())
        }),
        o("", "--max-queue-size", "<int>", "jobs queued or generating at once, all APIs together; more are refused with 429 (default: 64)", |s, v| {
            s.limits.max_queue_size = positive(v)? as usize;
            Ok(())
        }),
        o("", "--max-request-mb", "<int>", "largest request body in MiB; larger ones are refused with 413 (default: 64)", |s, v| {
            s.limits.max_body_bytes = (positive(v)? as usize).saturating_mul(1 << 20);
            Ok(())
        }),
        o("", "--max-width", "<int>", "largest width a request may ask for (default: 4096)", |s, v| {
            s.limits.max_width = positive(v)?;
            Ok(())
        }),
        o("", "--max-height", "<int>", "largest height a request may ask for (default: 4096)", |s, v| {
            s.limits.max_height = positive(v)?;
            Ok(())
        }),
        o("", "--max-batch-count", "<int>", "most images one request may ask for (default: 8)", |s, v| {
            s.limits.max_batch_count = positive(v)?;
            Ok(())
        }),
        o("", "--max-steps", "<int>", "most sampling steps one request may ask for (default: 150)", |s, v| {
            s.limits.max_steps = positive(v)?;
            Ok(())
        }),
        o("", "--max-video-frames", "<int>", "most video frames one request may ask for (default: 257)", |s, v| {
            s.limits.max_video_frames = positive(v)?;
            Ok(())
        }),
        o("", "--job-ttl", "<int>", "seconds a finished async job stays readable; then 410 Gone (default: 600)", |s, v| {
            s.limits.job_ttl_seconds = i64::from(positive(v)?);
            Ok(())
        }),
        o("-v", "--verbose", "", "print extra info", |s, _| {
            s.verbose = true;
            Ok(())
        }),
        o("", "--color", "", "colors the logging tags according to level", |s, _| {
            s.color = true;
            Ok(())
        }),
    ]
}

/// sd-cli options about one program run (output files, previews, modes) that a server has
/// no use for: refused by name rather than ignored.
fn is_cli_only(opt: &args::Opt) -> bool {
    opt.group == Group::Cli && !matches!(opt.long, "--help" | "--version" | "--verbose" | "--color")
}

/// Reads the command line (without the program name).
pub fn parse<S: AsRef<str>>(argv: &[S]) -> Result<Command, String> {
    let ours = server_options();
    let theirs = args::options();
    let mut server = ServerOpts::default();
    let mut rest: Vec<String> = Vec::new();
    let mut i = 0;
    while i < argv.len() {
        let arg = argv[i].as_ref();
        let named = |short: &str, long: &str| (!short.is_empty() && short == arg) || long == arg;
        if matches!(arg, "-h" | "--help") {
            return Ok(Command::Help);
        }
        if arg == "--version" {
            return Ok(Command::Version);
        }
        if let Some(o) = ours.iter().find(|o| named(o.short, o.long)) {
            let value = if o.hint.is_empty() {
                ""
            } else {
                i += 1;
                argv.get(i).map(|v| v.as_ref()).ok_or_else(|| format!("invalid parameter for argument: {arg}"))?
            };
            (o.set)(&mut server, value).map_err(|why| format!("{why}\ninvalid parameter for argument: {arg}"))?;
        } else {
            if let Some(o) = theirs.iter().find(|o| named(o.short, o.long)) {
                if is_cli_only(o) {
                    return Err(format!("{arg} is an sd-cli option (one program run); sd-server does not take it"));
                }
                if o.takes_value() {
                    rest.push(arg.to_string());
                    i += 1;
                    if let Some(v) = argv.get(i) {
                        rest.push(v.as_ref().to_string());
                    }
                    i += 1;
                    continue;
                }
            }
            rest.push(arg.to_string());
        }
        i += 1;
    }
    if server.listen_ip.is_empty() {
        return Err("the following arguments are required: listen_ip".into());
    }
    if !server.serve_html_path.is_empty() && !std::path::Path::new(&server.serve_html_path).is_file() {
        return Err(format!("serve_html_path file does not exist: {}", server.serve_html_path));
    }
    match args::parse(&rest).map_err(|e| e.0.trim_start_matches("error: ").to_string())? {
        Parsed::Run(o) => Ok(Command::Serve(Box::new(server), o)),
        Parsed::Help => Ok(Command::Help),
        Parsed::Version | Parsed::Info => Ok(Command::Version),
        Parsed::ListDevices => Ok(Command::ListDevices),
    }
}

/// The defaults every request starts from: sd-cli's resolution (default model, threads,
/// defaults that depend on several options) in image mode. A seed below 0 stays -1: each
/// request then draws its own, as in the reference's server.
pub fn resolve_defaults(o: &mut Opts, env: &dyn Fn(&str) -> Option<String>) -> Result<(), String> {
    let g = &o.gen;
    let v = &g.video;
    let per_request = [
        (!g.init_img.is_empty(), "--init-img"),
        (!g.mask.is_empty(), "--mask"),
        (!g.control_image.is_empty(), "--control-image"),
        (!g.ip_adapter_image.is_empty(), "--ip-adapter-image"),
        (!g.ref_images.is_empty(), "--ref-image"),
        (!g.pm_id_images_dir.is_empty(), "--pm-id-images-dir"),
        (!v.end_img.is_empty(), "--end-img"),
        (!v.control_video.is_empty(), "--control-video"),
        (!v.ref_videos.is_empty() || !v.ref_audios.is_empty() || !v.ref_video_audios.is_empty(), "--ref-video/--ref-audio"),
    ];
    if let Some((_, name)) = per_request.iter().find(|(given, _)| *given) {
        return Err(format!("{name}: input pictures are given by each request to sd-server, not on its command line"));
    }
    for (given, name) in [(!g.ad_model.is_empty(), "--ad-model"), (!o.ctx.upscale_model.is_empty(), "--upscale-model")] {
        if given {
            stable_diffusion::sd_warn!("{name} is not used by sd-server (no ADetailer / ESRGAN pass on its results): ignored");
        }
    }
    let random_seed = o.gen.params.seed < 0;
    o.resolve(env)?;
    if random_seed {
        o.gen.params.seed = -1;
    }
    // Tags in a default prompt are resolved per request, like the request's own.
    o.gen.params.prompt = o.gen.prompt_with_lora.clone();
    o.gen.loras.clear();
    o.gen.high_noise_loras.clear();
    Ok(())
}

/// The full usage text.
pub fn usage(program: &str) -> String {
    let mut out = format!("{}\nUsage: {program} [options]\n\nServer Options:\n", args::version_string());
    let ours = server_options();
    let width = ours.iter().map(|o| names(o).len()).max().unwrap_or(0) + 4;
    for o in &ours {
        out.push_str(&format!("  {:<width$}{}\n", names(o), o.help));
    }
    out.push_str(&format!("  {:<width$}show this help message and exit\n", "-h, --help"));
    // sd-cli's usage, less its one-run options, gives the context and default generation options.
    let cli = args::usage(program);
    let tail = cli.find("\nContext Options:").map_or(cli.as_str(), |at| &cli[at..]);
    out.push_str(&tail.replace("Generation Options:", "Default Generation Options (each request may override them):"));
    out
}

fn names(o: &ServerOpt) -> String {
    let hint = if o.hint.is_empty() { String::new() } else { format!(" {}", o.hint) };
    if o.short.is_empty() {
        format!("{}{hint}", o.long)
    } else {
        format!("{}, {}{hint}", o.short, o.long)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serve(argv: &[&str]) -> (ServerOpts, Opts) {
        match parse(argv) {
            Ok(Command::Serve(s, o)) => (*s, *o),
            other => panic!("{argv:?}: {other:?}"),
        }
    }

    #[test]
    fn server_and_model_options_are_split() {
        let (s, o) = serve(&["-m", "m.safetensors", "--listen-port", "0", "-l", "0.0.0.0", "--cfg-scale", "3", "--max-queue-size", "2", "-v"]);
        assert_eq!((s.listen_ip.as_str(), s.listen_port, s.limits.max_queue_size, s.verbose), ("0.0.0.0", 0, 2, true));
        assert_eq!(o.ctx.params.model_path.as_deref(), Some("m.safetensors"));
        assert_eq!(o.gen.params.sample_params.guidance.txt_cfg, 3.0);
        // A value that looks like a server option stays the sd-cli option's value.
        let (_, o) = serve(&["-p", "-v"]);
        assert_eq!(o.gen.params.prompt, "-v");
    }

    #[test]
    fn bad_command_lines_are_refused_with_the_reason() {
        for (argv, msg) in [
            (&["-o", "x.png"][..], "-o is an sd-cli option"),
            (&["--listen-port", "70000"][..], "not a valid port"),
            (&["--listen-port"][..], "invalid parameter for argument: --listen-port"),
            (&["--max-steps", "0"][..], "must be at least 1"),
            (&["--sampling-method", "nope"][..], "invalid sample method nope"),
            (&["--no-such-flag"][..], "unknown argument: --no-such-flag"),
            (&["--serve-html-path", "/nonexistent/index.html"][..], "does not exist"),
        ] {
            let e = parse(argv).unwrap_err();
            assert!(e.contains(msg), "{argv:?}: {e}");
        }
        let Ok(Command::Serve(_, mut o)) = parse(&["-m", "m.gguf", "-i", "cat.png"]) else { panic!() };
        assert!(resolve_defaults(&mut o, &|_| None).unwrap_err().contains("--init-img: input pictures are given by each request"));
        assert!(matches!(parse(&["--help"]), Ok(Command::Help)));
        assert!(matches!(parse(&["--list-devices"]), Ok(Command::ListDevices)));
    }

    #[test]
    fn usage_lists_both_kinds_of_options() {
        let u = usage("sd-server");
        for s in ["--listen-port", "--max-queue-size", "--diffusion-model", "--cfg-scale", "Default Generation Options"] {
            assert!(u.contains(s), "{s}");
        }
        assert!(!u.contains("--preview-path"));
    }
}
