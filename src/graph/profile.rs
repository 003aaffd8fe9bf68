//! Where a computation's time goes (`SD_PROFILE=1`).
//!
//! With the profiler on, every graph is computed node by node (`graph::observe`) and each
//! node's time is charged to its operation (our own ops by name) and to a module: the one
//! whose weights the node reads, else the module of its most recently computed input (an
//! attention's scores go to its projections, a residual sum to the branch it closes). A
//! graph belongs to a phase: its weights' common prefix (`model.diffusion_model`,
//! `first_stage_model`, …). When a generation ends (`generate_image`, `generate_video`,
//! `upscale`, ADetailer) the log gets per phase its computations and time, then its
//! operations, blocks (a module up to its first index: `input_blocks.4.1`, `double_blocks.3`)
//! and layers by time. Graphs computed on several devices at once count whole.

use super::runner::weight_buffer;
use ggml_sys as g;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::{Duration, Instant};

/// Whether the profiler is on (`SD_PROFILE=1`, read once).
pub fn enabled() -> bool {
    #[cfg(test)]
    if let Some(on) = FORCED.with(|f| f.get()) {
        return on;
    }
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| match std::env::var("SD_PROFILE") {
        Err(_) => false,
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "" | "0" | "off" | "false" | "no" => false,
            "1" | "on" | "true" | "yes" => true,
            _ => {
                sd_warn!("SD_PROFILE={v:?} is not 1 or 0: the profiler stays off");
                false
            }
        },
    })
}

#[cfg(test)]
thread_local! {
    static FORCED: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Tests: the profiler on for this thread while held.
#[cfg(test)]
pub(crate) struct Forced;

#[cfg(test)]
impl Forced {
    pub(crate) fn on() -> Forced {
        FORCED.with(|f| f.set(Some(true)));
        Forced
    }

    /// Switches it for this thread (until the guard's end).
    pub(crate) fn set(&self, on: bool) {
        FORCED.with(|f| f.set(Some(on)));
    }
}

#[cfg(test)]
impl Drop for Forced {
    fn drop(&mut self) {
        FORCED.with(|f| f.set(None));
    }
}

/// Weights' full names by tensor: ggml keeps 63 bytes of a name, a UNet's are longer.
static NAMES: LazyLock<Mutex<HashMap<usize, Arc<str>>>> = LazyLock::new(Default::default);

/// Remembers a weight's name while profiling.
pub(crate) fn name_weight(t: *mut g::ggml_tensor, name: &str) {
    if enabled() {
        NAMES.lock().insert(t as usize, name.into());
    }
}

/// Forgets weights that go away.
pub(crate) fn forget_weights(ts: impl Iterator<Item = *mut g::ggml_tensor>) {
    if enabled() {
        let mut names = NAMES.lock();
        ts.for_each(|t| {
            names.remove(&(t as usize));
        });
    }
}

/// A weight's name (base tensor of a view), None for tensors that are not weights.
fn weight_name(t: *mut g::ggml_tensor) -> Option<Arc<str>> {
    weight_buffer(t)?;
    // SAFETY: a live tensor of a graph.
    let base = unsafe { super::runner::view_base(t) };
    if let Some(n) = NAMES.lock().get(&(base as usize)) {
        return Some(n.clone());
    }
    // SAFETY: ggml keeps names NUL-terminated.
    let n = unsafe { CStr::from_ptr((*base).name.as_ptr()) }.to_string_lossy();
    (!n.is_empty()).then(|| n.as_ref().into())
}

/// `a.b.c.weight` → `a.b.c`.
fn module_of(weight: &str) -> &str {
    weight.rsplit_once('.').map_or(weight, |(m, _)| m)
}

/// What a node computes: ggml's name for the operation, or ours for our own operations.
fn op_label(t: *mut g::ggml_tensor) -> String {
    // SAFETY: a live node; op_params of a custom op start with its function pointer.
    unsafe {
        if (*t).op == g::GGML_OP_CUSTOM {
            let fun = std::ptr::read_unaligned((*t).op_params.as_ptr().cast::<usize>());
            return super::own_op_name(fun).unwrap_or("custom").to_string();
        }
        CStr::from_ptr(g::ggml_op_desc(t)).to_string_lossy().to_ascii_lowercase()
    }
}

/// The phase of a graph: its modules' common prefix, up to their first index, and short of
/// every module's whole name.
fn phase_of(modules: &[Arc<str>]) -> String {
    let Some(first) = modules.first() else { return "(no weights)".into() };
    let mut common: Vec<&str> = first.split('.').collect();
    for m in &modules[1..] {
        let n = common.iter().zip(m.split('.')).take_while(|(a, b)| *a == b).count();
        common.truncate(n);
    }
    if let Some(i) = common.iter().position(|c| c.parse::<u64>().is_ok()) {
        common.truncate(i);
    }
    if modules.iter().any(|m| m.split('.').count() == common.len()) {
        common.pop();
    }
    if common.is_empty() {
        "(model)".into()
    } else {
        common.join(".")
    }
}

/// A module's block: up to and including its first run of indices; without indices, its
/// parent (`decoder.mid.attn_1.q` → `decoder.mid.attn_1`) short of the top level.
fn block_of(module: &str) -> String {
    let parts: Vec<&str> = module.split('.').collect();
    let is_index = |s: &str| s.parse::<u64>().is_ok();
    match parts.iter().position(|s| is_index(s)) {
        Some(i) => {
            let end = i + parts[i..].iter().take_while(|s| is_index(s)).count();
            parts[..end].join(".")
        }
        None if parts.len() > 2 => parts[..parts.len() - 1].join("."),
        None => module.to_string(),
    }
}

#[derive(Default)]
struct Phase {
    computes: u32,
    wall: Duration,
    nodes: Duration,
    ops: HashMap<String, Duration>,
    blocks: HashMap<String, Duration>,
    layers: HashMap<String, Duration>,
}

/// The phases in order of first appearance.
static PHASES: Mutex<Vec<(String, Phase)>> = Mutex::new(Vec::new());

fn with_phase(name: String, f: impl FnOnce(&mut Phase)) {
    let mut phases = PHASES.lock();
    match phases.iter_mut().find(|(n, _)| *n == name) {
        Some((_, p)) => f(p),
        None => {
            let mut p = Phase::default();
            f(&mut p);
            phases.push((name, p));
        }
    }
}

/// Every node's module (None: it reads no weight, directly or through its inputs).
fn modules_of(gf: *mut g::ggml_cgraph) -> (Vec<Option<Arc<str>>>, Vec<Arc<str>>) {
    // SAFETY: nodes of a valid graph.
    let n = unsafe { g::ggml_graph_n_nodes(gf) };
    let mut at: HashMap<usize, (usize, Arc<str>)> = HashMap::new();
    let mut of_node = Vec::with_capacity(n as usize);
    let mut weighted: Vec<Arc<str>> = Vec::new();
    for i in 0..n {
        // SAFETY: i < n.
        let node = unsafe { g::ggml_graph_node(gf, i) };
        // SAFETY: a live node.
        let srcs: Vec<*mut g::ggml_tensor> = unsafe { (*node).src }.into_iter().filter(|s| !s.is_null()).collect();
        let module = match srcs.iter().find_map(|&s| weight_name(s)) {
            Some(w) => {
                let m: Arc<str> = module_of(&w).into();
                if !weighted.contains(&m) {
                    weighted.push(m.clone());
                }
                Some(m)
            }
            None => srcs.iter().filter_map(|s| at.get(&(*s as usize))).max_by_key(|(k, _)| *k).map(|(_, m)| m.clone()),
        };
        if let Some(m) = &module {
            at.insert(node as usize, (i as usize, m.clone()));
        }
        of_node.push(module);
    }
    (of_node, weighted)
}

/// Adds a graph computed node by node: `times` per piece, charged to the piece's last node.
pub(crate) fn record(gf: *mut g::ggml_cgraph, times: &[(*mut g::ggml_tensor, Duration)], wall: Duration) {
    let (of_node, weighted) = modules_of(gf);
    let phase = phase_of(&weighted);
    let prefix = format!("{phase}.");
    // SAFETY: nodes of a valid graph.
    let index: HashMap<usize, usize> = (0..of_node.len()).map(|i| (unsafe { g::ggml_graph_node(gf, i as i32) } as usize, i)).collect();
    with_phase(phase.clone(), |p| {
        p.computes += 1;
        p.wall += wall;
        for &(t, d) in times {
            p.nodes += d;
            *p.ops.entry(op_label(t)).or_default() += d;
            let module = index.get(&(t as usize)).and_then(|&i| of_node[i].clone());
            let layer = match &module {
                Some(m) => m.strip_prefix(prefix.as_str()).unwrap_or(m).to_string(),
                None => "(no weights)".to_string(),
            };
            *p.blocks.entry(block_of(&layer)).or_default() += d;
            *p.layers.entry(layer).or_default() += d;
        }
    });
}

/// Adds a graph computed whole (over several devices): its time only.
pub(crate) fn record_whole(gf: *mut g::ggml_cgraph, wall: Duration) {
    let (_, weighted) = modules_of(gf);
    with_phase(phase_of(&weighted), |p| {
        p.computes += 1;
        p.wall += wall;
    });
}

const TOP_OPS: usize = 10;
const TOP_BLOCKS: usize = 10;
const TOP_LAYERS: usize = 12;

/// The report of everything recorded since the last one, which it clears.
pub fn take_report(what: &str, elapsed: Duration) -> Vec<String> {
    let phases = std::mem::take(&mut *PHASES.lock());
    let computing: Duration = phases.iter().map(|(_, p)| p.wall).sum();
    let n: u32 = phases.iter().map(|(_, p)| p.computes).sum();
    let mut out = vec![format!(
        "profile of {what}: {:.2} s, {:.2} s of it in {n} graph computations",
        elapsed.as_secs_f64(),
        computing.as_secs_f64()
    )];
    let mut phases = phases;
    phases.sort_by(|a, b| b.1.wall.cmp(&a.1.wall));
    for (name, p) in &phases {
        let each = p.wall.as_secs_f64() * 1e3 / p.computes.max(1) as f64;
        let mut head = format!("  {name}: {} computations, {:.2} s ({each:.1} ms each)", p.computes, p.wall.as_secs_f64());
        if p.nodes > Duration::ZERO {
            head += &format!(", {:.0} % of it inside the nodes", 100.0 * p.nodes.as_secs_f64() / p.wall.as_secs_f64().max(1e-12));
        }
        out.push(head);
        for (title, table, top) in [("operations", &p.ops, TOP_OPS), ("blocks", &p.blocks, TOP_BLOCKS), ("layers", &p.layers, TOP_LAYERS)] {
            if table.is_empty() {
                continue;
            }
            let mut rows: Vec<(&String, &Duration)> = table.iter().collect();
            rows.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
            out.push(format!("    {title} (the {} of {} that took longest):", rows.len().min(top), rows.len()));
            let total = p.nodes.as_secs_f64().max(1e-12);
            for (k, d) in rows.into_iter().take(top) {
                out.push(format!("      {:>9.3} s {:>5.1} %  {k}", d.as_secs_f64(), 100.0 * d.as_secs_f64() / total));
            }
        }
    }
    out
}

/// One generation's profile: logged when the outermost session ends.
pub struct Session {
    outer: Option<(&'static str, Instant)>,
}

static DEPTH: Mutex<u32> = Mutex::new(0);

impl Session {
    pub fn start(what: &'static str) -> Session {
        if !enabled() {
            return Session { outer: None };
        }
        let mut depth = DEPTH.lock();
        *depth += 1;
        if *depth == 1 {
            // What was computed before (loading, another call) is not this call's.
            PHASES.lock().clear();
            return Session { outer: Some((what, Instant::now())) };
        }
        Session { outer: None }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if !enabled() {
            return;
        }
        let mut depth = DEPTH.lock();
        *depth = depth.saturating_sub(1);
        if let Some((what, start)) = self.outer {
            for line in take_report(what, start.elapsed()) {
                sd_info!("{line}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_blocks_and_modules_are_named_from_weights() {
        let m = |v: &[&str]| v.iter().map(|s| Arc::<str>::from(*s)).collect::<Vec<_>>();
        assert_eq!(
            phase_of(&m(&["model.diffusion_model.input_blocks.1.1.proj_in", "model.diffusion_model.out.2", "model.diffusion_model.time_embed.0"])),
            "model.diffusion_model"
        );
        assert_eq!(phase_of(&m(&["first_stage_model.decoder.conv_in", "first_stage_model.post_quant_conv"])), "first_stage_model");
        assert_eq!(phase_of(&m(&["net.blk.0.lin", "net.blk.1.lin"])), "net.blk");
        assert_eq!(phase_of(&m(&["net.lin"])), "net");
        assert_eq!(phase_of(&m(&["lin"])), "(model)");
        assert_eq!(phase_of(&[]), "(no weights)");
        assert_eq!(block_of("input_blocks.4.1.transformer_blocks.0.attn1.to_q"), "input_blocks.4.1");
        assert_eq!(block_of("double_blocks.3.img_attn.qkv"), "double_blocks.3");
        assert_eq!(block_of("decoder.mid.attn_1.q"), "decoder.mid.attn_1");
        assert_eq!(block_of("decoder.norm_out"), "decoder.norm_out");
        assert_eq!(module_of("a.b.weight"), "a.b");
    }
}
