//! LTX-2.3's embeddings connectors (`video_embeddings_connector.`,
//! `audio_embeddings_connector.`; the released model ships them with the text projection in
//! `embeddings_connectors_path`, under the transformer's names): the prompt's states are
//! lengthened with the connector's learnable registers to a multiple of their count of at
//! least 1024 tokens, then pass 1-D transformer blocks (RMS norm, self-attention with rotary
//! positions, RMS norm, GELU MLP, each residual) and a final RMS norm; the result is the
//! stream's text context. Sizes come from the weights like the reference's.

use super::block::Attention;
use super::layout;
use crate::graph::{Graph, Scope, TypeMap, F32, T, W};
use crate::models::common::blocks::FeedForward;

const EPS: f32 = 1e-6;
/// The connectors' rotary positions: token index over this, θ 10000.
const POSITION_SCALE: f64 = 4096.0;
const THETA: f64 = 10000.0;
/// A context is lengthened to at least this many tokens.
const MIN_TOKENS: usize = 1024;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectorConfig {
    pub hidden: i64,
    pub heads: i64,
    pub head_dim: i64,
    pub layers: usize,
    pub registers: i64,
    pub gated: bool,
}

impl ConnectorConfig {
    /// The connector `name` (`video_embeddings_connector`) under the transformer's `prefix`.
    pub fn detect(types: &TypeMap, shape: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str, name: &str) -> Option<ConnectorConfig> {
        let p = format!("{prefix}{name}.");
        let hidden = shape(&format!("{p}transformer_1d_blocks.0.attn1.to_q.weight")).filter(|s| s.len() == 2)?[1];
        let gate_heads = shape(&format!("{p}transformer_1d_blocks.0.attn1.to_gate_logits.bias")).map_or(32, |s| s[0]);
        let (heads, head_dim) = layout(hidden, Some(gate_heads));
        let layers = types
            .keys()
            .filter_map(|n| n.strip_prefix(&p)?.strip_prefix("transformer_1d_blocks."))
            .filter_map(|rest| rest.split_once('.')?.0.parse::<usize>().ok())
            .max()
            .map_or(0, |b| b + 1);
        let registers = shape(&format!("{p}learnable_registers")).filter(|s| s.len() == 2).map_or(128, |s| s[1]);
        let gated = types.contains_key(&format!("{p}transformer_1d_blocks.0.attn1.to_gate_logits.weight"));
        Some(ConnectorConfig { hidden, heads, head_dim, layers, registers, gated })
    }

    /// Tokens of a context of `tokens` after the registers: `tokens` lengthened to a multiple
    /// of the registers' count, at least 1024 (unchanged without registers or when longer).
    pub fn tokens_after(&self, tokens: usize) -> usize {
        let r = self.registers.max(0) as usize;
        if r == 0 {
            return tokens;
        }
        let full = tokens.max(MIN_TOKENS).div_ceil(r) * r;
        full.max(tokens)
    }

    /// The rotary table of `tokens` positions (`[2, 2, head_dim / 2, tokens · heads]`),
    /// frequencies and angles in f64 like the reference's, rounded to f32.
    pub fn rope(&self, tokens: usize) -> Vec<f32> {
        let half = (self.hidden / 2) as usize;
        let count = half;
        let freqs: Vec<f64> = match count {
            0 => Vec::new(),
            1 => vec![std::f64::consts::FRAC_PI_2],
            _ => (0..count).map(|i| (THETA.ln() * (i as f64 / (count - 1) as f64)).exp() * std::f64::consts::FRAC_PI_2).collect(),
        };
        let heads = self.heads as usize;
        let per_head = half / heads;
        let mut out = Vec::with_capacity(tokens * half * 4);
        for pos in 0..tokens {
            let coord = pos as f64 / POSITION_SCALE;
            for head in 0..heads {
                for &f in &freqs[head * per_head..(head + 1) * per_head] {
                    let a = (f * (coord * 2.0 - 1.0)) as f32;
                    let (s, c) = (a.sin(), a.cos());
                    out.extend_from_slice(&[c, -s, s, c]);
                }
            }
        }
        out
    }
}

#[derive(Clone, Debug)]
pub struct Connector {
    pub config: ConnectorConfig,
    registers: Option<W>,
    blocks: Vec<(Attention, FeedForward)>,
}

impl Connector {
    /// The connector under `s` (`video_embeddings_connector`).
    pub fn new(s: &mut Scope, c: &ConnectorConfig) -> Connector {
        let registers = (c.registers > 0).then(|| {
            let ty = s.file_type("learnable_registers").unwrap_or(F32);
            s.tensor("learnable_registers", ty, &[c.hidden, c.registers])
        });
        let blocks = (0..c.layers)
            .map(|i| {
                let mut b = s.sub(&format!("transformer_1d_blocks.{i}"));
                let attn = Attention::new(&mut b.sub("attn1"), c.hidden, c.hidden, c.heads, c.head_dim, c.gated);
                (attn, FeedForward::gelu(&mut b.sub("ff"), c.hidden, c.hidden, 4, 1.0))
            })
            .collect();
        Connector { config: c.clone(), registers, blocks }
    }

    /// [`Connector::forward`] with its rotary table for a context of `tokens`, built here.
    pub fn forward_with_rope<'g>(&self, g: &'g Graph, x: T<'g>, tokens: usize) -> T<'g> {
        let len = self.config.tokens_after(tokens);
        let pe = g.input_f32(&self.config.rope(len), &[2, 2, self.config.head_dim / 2, len as i64 * self.config.heads]);
        self.forward(g, x, pe)
    }

    /// The prompt's states `[hidden, L]` → the context `[hidden, tokens_after(L)]`; `pe` is
    /// [`ConnectorConfig::rope`] of that length.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pe: T<'g>) -> T<'g> {
        let [hidden, len, _, _] = x.ne();
        let full = self.config.tokens_after(len as usize) as i64;
        let mut x = x;
        if let (Some(regs), true) = (self.registers, full > len) {
            let regs = g.param(regs);
            let r = self.config.registers;
            let tiled = (1..(full + r - 1) / r).fold(regs, |acc, _| acc.concat(regs, 1));
            let nb = tiled.nb();
            let tail = tiled.view(&[hidden, full - len], &[nb[1]], len as usize * nb[1]).cont();
            x = x.concat(tail, 1);
        }
        for (attn, ff) in &self.blocks {
            x = x.add(attn.forward(g, x.rms_norm(EPS), None, Some(pe), None));
            x = x.add(ff.forward(g, x.rms_norm(EPS)));
        }
        x.rms_norm(EPS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(registers: i64) -> ConnectorConfig {
        ConnectorConfig { hidden: 8, heads: 2, head_dim: 4, layers: 1, registers, gated: false }
    }

    #[test]
    fn contexts_are_lengthened_to_whole_register_runs_of_at_least_1024() {
        assert_eq!(config(128).tokens_after(17), 1024);
        assert_eq!(config(100).tokens_after(17), 1100);
        assert_eq!(config(128).tokens_after(1030), 1152);
        assert_eq!(config(0).tokens_after(17), 17);
    }

    #[test]
    fn rotary_positions_start_at_minus_one() {
        let t = config(128).rope(3);
        assert_eq!(t.len(), 3 * 2 * 2 * 4);
        // Token 0, head 0, first frequency (π/2): angle -π/2.
        let a = -std::f32::consts::FRAC_PI_2;
        assert_eq!(&t[..4], &[a.cos(), -a.sin(), a.sin(), a.cos()]);
    }
}
