//! Importance-matrix collection for quantization (the llama.cpp / stable-diffusion.cpp
//! `.dat` imatrix format).
//!
//! While collection is enabled the backend evaluation callback hands every matrix
//! multiplication to [`Collector::collect`], which accumulates the squared activations per
//! input column of the weight. `save` writes them; `load` merges a file in; quantization
//! reads a weight's row importances with [`Collector::values`].
//!
//! File layout (native-endian, as the reference writes it): `i32 n_entries`, then per entry
//! `i32 name_len, name bytes, i32 ncall, i32 nval, f32 values[nval]` (each value is the mean
//! square times `ncall`), then `i32 last_call`.

use crate::error::{Context as _, Result};
use crate::graph::eval_callback::{self, EvalTensor};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// Accumulated statistics of one weight.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// Sum of squared activations per column (per expert × column for MoE weights).
    pub values: Vec<f32>,
    /// Number of finite activations summed into each value.
    pub counts: Vec<i32>,
    /// Number of graph evaluations that contributed.
    pub ncall: i32,
}

#[derive(Debug, Default)]
pub struct Collector {
    stats: BTreeMap<String, Stats>,
    last_call: i32,
}

static COLLECTOR: once_cell::sync::Lazy<Mutex<Collector>> = once_cell::sync::Lazy::new(|| Mutex::new(Collector::new()));

/// The process-wide collector the C API and the model loader share.
pub fn collector() -> &'static Mutex<Collector> {
    &COLLECTOR
}

/// The loaded (or collected) importance matrix as the quantizer's per-weight lookup, when
/// there is one: model loads and `convert` quantize with it, as the reference does.
pub fn importance() -> Option<Arc<dyn Fn(&str) -> Vec<f32> + Send + Sync>> {
    if collector().lock().is_empty() {
        return None;
    }
    Some(Arc::new(|weight: &str| collector().lock().values(weight)))
}

/// Routes the backend evaluation callback to the process-wide collector.
pub fn enable_collection() {
    eval_callback::set(Some(Arc::new(|t: EvalTensor<'_>, ask: bool| {
        if ask {
            Collector::wants(&t)
        } else {
            collector().lock().collect(&t)
        }
    })));
}

/// Removes the backend evaluation callback (whoever installed it, like the reference).
pub fn disable_collection() {
    eval_callback::set(None);
}

/// `CUDA0#blk.0.attn_k.weight#0` → `blk.0.attn_k.weight`: strips the scheduler's copy marks.
pub fn weight_name(name: &str) -> &str {
    match name.split_once('#') {
        Some((_, rest)) => rest.split_once('#').map_or(rest, |(w, _)| w),
        None => name,
    }
}

/// Weights whose activations are collected: the diffusion model and text encoders.
pub fn is_collected_weight(name: &str) -> bool {
    ["model.", "cond_stage_model.", "text_encoders."].iter().any(|p| name.starts_with(p))
}

impl Collector {
    pub fn new() -> Self {
        Collector::default()
    }

    pub fn is_empty(&self) -> bool {
        self.stats.is_empty()
    }

    pub fn clear(&mut self) {
        self.stats.clear();
    }

    /// Accumulated statistics of a weight.
    pub fn stats(&self, weight: &str) -> Option<&Stats> {
        self.stats.get(weight)
    }

    /// The accumulated values of a weight, for quantization (empty when never seen).
    pub fn values(&self, weight: &str) -> Vec<f32> {
        self.stats.get(weight).map(|s| s.values.clone()).unwrap_or_default()
    }

    /// The scheduler's "ask" phase: does this node's data interest us?
    pub fn wants(t: &EvalTensor<'_>) -> bool {
        if !(t.is_mul_mat() || t.is_mul_mat_id()) {
            return false;
        }
        let (Some(src0), Some(_)) = (t.src(0), t.src(1)) else { return false };
        t.is_mul_mat_id() || is_collected_weight(weight_name(&src0.name()))
    }

    /// The scheduler's data phase: accumulates the node's activations. Returns whether
    /// computation should go on (always, unless the node is not a matrix product).
    pub fn collect(&mut self, t: &EvalTensor<'_>) -> bool {
        if !(t.is_mul_mat() || t.is_mul_mat_id()) {
            return false;
        }
        let (Some(src0), Some(src1)) = (t.src(0), t.src(1)) else { return false };
        let wname = weight_name(&src0.name()).to_string();
        let Some(data) = src1.read_f32() else {
            sd_debug!("imatrix: skipping {wname}: activations are not f32");
            return true;
        };
        let ne = src1.ne();
        let (cols, ne1, ne2) = (ne[0].max(0) as usize, ne[1].max(0) as usize, ne[2].max(0) as usize);
        let result = if t.is_mul_mat_id() {
            collect_mul_mat_id(self, t, &src0, &src1, &wname, &data, cols, ne1, ne2)
        } else {
            // Like the reference, only the first ne[1] rows count (the first matrix of a
            // batched product), so that imatrix files come out the same.
            let mut rows = gather_rows(&data, &src1, cols);
            rows.truncate(cols * ne1);
            self.add_mul_mat(&wname, cols, &rows)
        };
        if let Err(e) = result {
            sd_error!("imatrix: {e}");
        }
        true
    }

    /// Adds one evaluation of a plain matrix product: `activations` holds whole rows of
    /// `cols` values (the product's right-hand side). Non-finite inputs are skipped.
    pub fn add_mul_mat(&mut self, weight: &str, cols: usize, activations: &[f32]) -> Result<()> {
        ensure!(cols > 0, "{weight}: empty activation rows");
        let e = self.stats.entry(weight.to_string()).or_default();
        if e.values.is_empty() {
            e.values = vec![0.0; cols];
            e.counts = vec![0; cols];
        } else if e.values.len() != cols {
            bail!("inconsistent size for {weight} ({} vs {cols})", e.values.len());
        }
        e.ncall += 1;
        let mut overflow = false;
        for row in activations.chunks_exact(cols) {
            for (j, &x) in row.iter().enumerate() {
                if x.is_finite() {
                    e.values[j] += x * x;
                    e.counts[j] += 1;
                    overflow |= !e.values[j].is_finite();
                }
            }
        }
        ensure!(!overflow, "non-finite sum detected in {weight}");
        Ok(())
    }

    /// Adds one evaluation of an expert-routed product (`mul_mat_id`).
    ///
    /// `ids[token * n_ids + k]` is the k-th expert chosen for `token`; its activation row is
    /// `activation(k, token)` (`cols` values). Statistics are kept per expert × column.
    pub fn add_mul_mat_id<'d>(
        &mut self,
        weight: &str,
        n_experts: usize,
        cols: usize,
        n_ids: usize,
        ids: &[i32],
        activation: impl Fn(usize, usize) -> &'d [f32],
    ) -> Result<()> {
        ensure!(cols > 0 && n_experts > 0, "{weight}: empty expert product");
        let size = n_experts.checked_mul(cols).context("expert statistics too large")?;
        let e = self.stats.entry(weight.to_string()).or_default();
        e.ncall += 1;
        if e.values.is_empty() {
            e.values = vec![0.0; size];
            e.counts = vec![0; size];
        } else if e.values.len() != size {
            bail!("inconsistent size for {weight} ({} vs {size})", e.values.len());
        }
        let n_tokens = ids.len().checked_div(n_ids).unwrap_or(0);
        // Per (expert, column) the sums run over k, then tokens, like the reference.
        for k in 0..n_ids {
            for token in 0..n_tokens {
                let ex = ids[token * n_ids + k];
                ensure!(ex >= 0 && (ex as usize) < n_experts, "{weight}: expert id {ex} out of range");
                let start = ex as usize * cols;
                let x = activation(k, token);
                for (j, &v) in x.iter().take(cols).enumerate() {
                    e.values[start + j] += v * v;
                    e.counts[start + j] += 1;
                    ensure!(e.values[start + j].is_finite(), "non-finite sum detected in {weight}");
                }
            }
        }
        Ok(())
    }

    /// Writes the entries that have data for every column (to a temporary name, then renamed).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut names: Vec<&String> = Vec::new();
        let mut keys: Vec<&String> = self.stats.keys().collect();
        keys.sort();
        for name in keys {
            let s = &self.stats[name];
            if s.counts.is_empty() {
                continue;
            }
            let zeros = s.counts.iter().filter(|&&c| c == 0).count();
            if zeros == s.counts.len() {
                sd_warn!("entry '{name:>40}' has no data - skipping");
                continue;
            }
            if zeros > 0 {
                let pct = 100.0 * (s.counts.len() - zeros) as f32 / s.counts.len() as f32;
                sd_warn!("entry '{name:>40}' has partial data ({pct:.2}%) - skipping");
                continue;
            }
            names.push(name);
        }
        if names.len() < self.stats.len() {
            sd_warn!("storing only {} out of {} entries", names.len(), self.stats.len());
        }

        let mut out = Vec::new();
        out.extend_from_slice(&(names.len() as i32).to_ne_bytes());
        for name in names {
            let s = &self.stats[name];
            out.extend_from_slice(&(name.len() as i32).to_ne_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&s.ncall.to_ne_bytes());
            out.extend_from_slice(&(s.values.len() as i32).to_ne_bytes());
            for (v, c) in s.values.iter().zip(&s.counts) {
                let mean = (v / *c as f32) * s.ncall as f32;
                out.extend_from_slice(&mean.to_ne_bytes());
            }
        }
        out.extend_from_slice(&self.last_call.to_ne_bytes());
        write_atomically(path, &out)
    }

    /// Merges an imatrix file into the collected statistics; on any error nothing changes.
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let bytes = std::fs::read(path).with_context(|| format!("failed to open {}", path.display()))?;
        let entries = parse(&bytes).with_context(|| format!("invalid imatrix file {}", path.display()))?;
        let mut merged = self.stats.clone();
        for (name, ncall, values) in entries {
            let e = merged.entry(name).or_default();
            if e.values.is_empty() {
                e.values = vec![0.0; values.len()];
                e.counts = vec![0; values.len()];
            } else if e.values.len() != values.len() {
                bail!(
                    "{}: inconsistent size for a repeated entry ({} vs {})",
                    path.display(),
                    e.values.len(),
                    values.len()
                );
            }
            for (i, v) in values.iter().enumerate() {
                e.values[i] += v;
                e.counts[i] += ncall;
            }
            e.ncall += ncall;
        }
        self.stats = merged;
        Ok(())
    }
}

/// Writes `bytes` to a temporary file next to `path`, then renames it over `path`.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path.file_name().with_context(|| format!("invalid output path {}", path.display()))?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(format!(".tmp{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let written = std::fs::write(&tmp, bytes).and_then(|_| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.with_context(|| format!("failed to write {}", path.display()))
}

/// Reads the entries of an imatrix file: (name, ncall, values).
fn parse(bytes: &[u8]) -> Result<Vec<(String, i32, Vec<f32>)>> {
    let mut r = Reader { bytes, pos: 0 };
    let n = r.i32().context("no data")?;
    ensure!(n >= 1, "no data");
    let mut entries = Vec::new();
    for i in 0..n {
        let len = r.i32().with_context(|| format!("failed reading name for entry {}", i + 1))?;
        ensure!(len >= 0, "failed reading name for entry {}", i + 1);
        let name = r.take(len as usize).with_context(|| format!("failed reading name for entry {}", i + 1))?;
        // The reference keeps the name up to its first NUL.
        let name = name.split(|&b| b == 0).next().unwrap_or_default();
        let name = String::from_utf8_lossy(name).into_owned();
        let ncall = r.i32().with_context(|| format!("failed reading number of values for entry {i}"))?;
        let nval = r.i32().with_context(|| format!("failed reading number of values for entry {i}"))?;
        ensure!(nval >= 1, "failed reading number of values for entry {i}");
        let data = r
            .take((nval as usize).checked_mul(4).context("entry too large")?)
            .with_context(|| format!("failed reading data for entry {i}"))?;
        let values = data.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect();
        entries.push((name, ncall, values));
    }
    Ok(entries)
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.bytes.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    fn i32(&mut self) -> Option<i32> {
        self.take(4).map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    }
}

/// The rows of a (possibly strided) f32 tensor as one dense `rows × cols` buffer.
fn gather_rows(data: &[f32], t: &EvalTensor<'_>, cols: usize) -> Vec<f32> {
    let ne = t.ne();
    let nb = t.nb();
    let contiguous = nb[0] == 4
        && nb[1] == cols * 4
        && nb[2] == nb[1] * ne[1].max(1) as usize
        && nb[3] == nb[2] * ne[2].max(1) as usize;
    if contiguous {
        return data.to_vec();
    }
    let mut out = Vec::with_capacity(data.len());
    for i3 in 0..ne[3].max(0) as usize {
        for i2 in 0..ne[2].max(0) as usize {
            for i1 in 0..ne[1].max(0) as usize {
                for i0 in 0..cols {
                    let off = (i0 * nb[0] + i1 * nb[1] + i2 * nb[2] + i3 * nb[3]) / 4;
                    out.push(data.get(off).copied().unwrap_or(f32::NAN));
                }
            }
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn collect_mul_mat_id(
    c: &mut Collector,
    t: &EvalTensor<'_>,
    src0: &EvalTensor<'_>,
    src1: &EvalTensor<'_>,
    wname: &str,
    data: &[f32],
    cols: usize,
    ne1: usize,
    ne2: usize,
) -> Result<()> {
    // ids: [n_expert_used, n_tokens] i32, not necessarily contiguous.
    let ids_t = t.src(2).context("mul_mat_id without ids")?;
    let raw = ids_t.read_bytes().context("could not read expert ids")?;
    let (ids_ne, ids_nb) = (ids_t.ne(), ids_t.nb());
    let n_ids = ids_ne[0].max(0) as usize;
    ensure!(ids_ne[1].max(0) as usize == ne2, "{wname}: expert ids do not match the tokens");
    let mut ids = Vec::with_capacity(n_ids * ne2);
    for token in 0..ne2 {
        for k in 0..n_ids {
            let off = token * ids_nb[1] + k * ids_nb[0];
            let b = raw.get(off..off + 4).context("expert ids out of bounds")?;
            ids.push(i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
        }
    }
    let nb = src1.nb();
    let n_experts = src0.ne()[2].max(0) as usize;
    let empty: &[f32] = &[];
    c.add_mul_mat_id(wname, n_experts, cols, n_ids, &ids, |k, token| {
        let i11 = if ne1 == 0 { 0 } else { k % ne1 };
        let start = (i11 * nb[1] + token * nb[2]) / 4;
        data.get(start..start + cols).unwrap_or(empty)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Quantization sees the collected values only while the collector holds some.
    #[test]
    fn quantization_reads_the_collected_values() {
        // The process-wide collector; no other unit test fills it.
        collector().lock().clear();
        assert!(importance().is_none());
        collector().lock().add_mul_mat("blk.0.w", 2, &[1.0, 2.0]).unwrap();
        let lookup = importance().expect("values loaded");
        assert_eq!(lookup("blk.0.w"), vec![1.0, 4.0]);
        assert!(lookup("blk.1.w").is_empty());
        collector().lock().clear();
    }

    #[test]
    fn names_and_filter() {
        assert_eq!(weight_name("CUDA0#blk.0.attn_k.weight#0"), "blk.0.attn_k.weight");
        assert_eq!(weight_name("CPU#model.x"), "model.x");
        assert_eq!(weight_name("model.x"), "model.x");
        assert!(is_collected_weight("model.diffusion_model.out.2.weight"));
        assert!(is_collected_weight("text_encoders.clip_l.transformer.w"));
        assert!(!is_collected_weight("first_stage_model.decoder.conv_in.weight"));
    }

    #[test]
    fn accumulate_save_load_round_trip() {
        let mut c = Collector::new();
        c.add_mul_mat("model.a", 3, &[1.0, 2.0, f32::NAN, 3.0, 0.0, 1.0]).unwrap();
        c.add_mul_mat("model.a", 3, &[1.0, 1.0, 1.0]).unwrap();
        c.add_mul_mat("model.partial", 2, &[f32::INFINITY, 1.0]).unwrap();
        assert!(c.add_mul_mat("model.a", 4, &[0.0; 4]).is_err());
        let s = c.stats("model.a").unwrap();
        assert_eq!(s.values, vec![11.0, 5.0, 2.0]);
        assert_eq!(s.counts, vec![3, 3, 2]);
        assert_eq!(s.ncall, 2);

        let dir = std::env::temp_dir().join(format!("sd-imatrix-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.dat");
        c.save(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        // 1 entry ("model.partial" lacks data for a column), then last_call.
        assert_eq!(i32::from_ne_bytes(bytes[0..4].try_into().unwrap()), 1);
        assert_eq!(bytes.len(), 4 + 4 + 7 + 4 + 4 + 3 * 4 + 4);

        let mut d = Collector::new();
        d.load(&path).unwrap();
        let s = d.stats("model.a").unwrap();
        assert_eq!(s.ncall, 2);
        assert_eq!(s.counts, vec![2, 2, 2]);
        let expect = [11.0 / 3.0 * 2.0, 5.0 / 3.0 * 2.0, 2.0 / 2.0 * 2.0];
        for (v, e) in s.values.iter().zip(expect) {
            assert!((v - e).abs() < 1e-5, "{v} vs {e}");
        }
        // Loading again merges.
        d.load(&path).unwrap();
        assert_eq!(d.stats("model.a").unwrap().ncall, 4);

        // Truncated and empty files are rejected without touching the state.
        std::fs::write(&path, &bytes[..bytes.len() - 9]).unwrap();
        assert!(d.load(&path).is_err());
        std::fs::write(&path, 0i32.to_ne_bytes()).unwrap();
        assert!(d.load(&path).is_err());
        std::fs::write(&path, [1, 0, 0, 0, 255, 255, 255, 127]).unwrap();
        assert!(d.load(&path).is_err());
        assert_eq!(d.stats("model.a").unwrap().ncall, 4);
        assert!(d.load(&dir.join("missing.dat")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn experts() {
        let mut c = Collector::new();
        // 2 tokens, 2 experts used each, 3 experts, 2 columns.
        let acts = [[1.0f32, 2.0], [3.0, 4.0]];
        let ids = [0, 2, 2, 1];
        c.add_mul_mat_id("blk.ffn", 3, 2, 2, &ids, |k, _token| &acts[k][..]).unwrap();
        let s = c.stats("blk.ffn").unwrap();
        assert_eq!(s.counts, vec![1, 1, 1, 1, 2, 2]);
        assert_eq!(s.values, vec![1.0, 4.0, 9.0, 16.0, 10.0, 20.0]);
        assert!(c.add_mul_mat_id("blk.ffn", 3, 2, 1, &[7], |_, _| &acts[0][..]).is_err());
    }

    fn named(name: &str) -> ggml_sys::ggml_tensor {
        // SAFETY: ggml_tensor is plain data; all-zero is a valid "empty" tensor.
        let mut t: ggml_sys::ggml_tensor = unsafe { std::mem::zeroed() };
        for (d, s) in t.name.iter_mut().zip(name.bytes()) {
            *d = s as libc::c_char;
        }
        t
    }

    #[test]
    fn collects_from_graph_nodes() {
        use ggml_sys as g;
        let mut w = named("CPU#model.diffusion_model.out.weight#0");
        let mut acts = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0];
        let mut x = named("x");
        x.type_ = g::GGML_TYPE_F32;
        // 3 columns, 2 rows, and a second matrix of the batch that is not counted.
        x.ne = [3, 2, 2, 1];
        x.nb = [4, 12, 24, 48];
        x.data = acts.as_mut_ptr().cast();
        let mut node = named("mm");
        node.op = g::GGML_OP_MUL_MAT;
        node.src[0] = &mut w;
        node.src[1] = &mut x;
        // SAFETY: the tensors live on this stack frame for the whole test.
        let view = unsafe { EvalTensor::from_raw(std::ptr::NonNull::from(&mut node)) };
        assert!(Collector::wants(&view));
        let mut c = Collector::new();
        assert!(c.collect(&view));
        let s = c.stats("model.diffusion_model.out.weight").unwrap();
        assert_eq!(s.values, vec![17.0, 29.0, 45.0]);
        assert_eq!(s.ncall, 1);

        let mut vae = named("first_stage_model.decoder.conv.weight");
        node.src[0] = &mut vae;
        // SAFETY: as above.
        let view = unsafe { EvalTensor::from_raw(std::ptr::NonNull::from(&mut node)) };
        assert!(!Collector::wants(&view));
        node.op = g::GGML_OP_ADD;
        // SAFETY: as above.
        let view = unsafe { EvalTensor::from_raw(std::ptr::NonNull::from(&mut node)) };
        assert!(!Collector::wants(&view) && !c.collect(&view));
    }
}
