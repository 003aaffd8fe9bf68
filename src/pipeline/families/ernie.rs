//! ERNIE-Image: the Ministral 3B LLM conditioner ([`ERNIE_TEMPLATE`]), the ERNIE-Image
//! transformer and Flux.2's 32-channel AutoencoderKL with patchified, normalised latents.
//! Flow prediction with the default shift 4, like the reference.

use super::flux::DIT_PREFIX;
use super::{ensure_text_width, first_stage, flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::Module;
use crate::models::diffusion::ernie_image::{ErnieImageConfig, ErnieImageModel};
use crate::models::te::llm::LlmArch;
use crate::pipeline::conditioning::llm::{LlmConditioner, LlmTemplate};
use crate::types::Prediction;

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 4.0;

/// The prompt alone (BOS first, no chat template), read after layer 25 (`[-2]` of the 26).
pub const ERNIE_TEMPLATE: LlmTemplate = LlmTemplate {
    arch: LlmArch::Ministral3b,
    prefix: "",
    suffix: "",
    lead: "",
    out_layers: &[25],
    min_length: 0,
    drop_first: 0,
    zero_pad_to: 0,
    max_length: 0,
};

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let cfg = ErnieImageConfig::detect(weights.types(), &|n| weights.shape_of(n), DIT_PREFIX);
    cfg.validate()?;
    ctx.ensure_latent_channels(cfg.in_channels, "the ERNIE-Image transformer", "the Flux.2 VAE's patchified latents have")?;
    let cond = LlmConditioner::new(weights, ERNIE_TEMPLATE, &te_place, n_threads, params.eager_load)?;
    ensure_text_width(cond.context_width() as i64, cfg.text_in_dim, "the ERNIE-Image transformer", "the Ministral 3B it pairs with has 26 layers")?;

    let model = ctx.load_transformer(DIT_PREFIX, |s| ErnieImageModel::new(s, &cfg))?;
    let first = first_stage::build(ctx, vae_place)?;
    Ok(flow_parts(params, Box::new(cond), Box::new(model), first, Prediction::Flow, DEFAULT_FLOW_SHIFT))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::te::mistral_tokenizer::{self, BOS_TOKEN};
    use crate::pipeline::conditioning::llm::tokenize;

    /// BOS, then the prompt's weighted pieces; the empty prompt is BOS alone.
    #[test]
    fn prompt_tokens() {
        let tok = mistral_tokenizer::shared().unwrap();
        let t = tokenize(tok, &ERNIE_TEMPLATE, "a lovely cat");
        assert_eq!(t.ids, [BOS_TOKEN, 1097, 45988, 7990]);
        let t = tokenize(tok, &ERNIE_TEMPLATE, "a (red:1.4) apple");
        assert_eq!(t.ids[1..], [1097, 1032, 2338, 46227]);
        assert_eq!(t.weights, [1.0, 1.0, 1.0, 1.4, 1.0]);
        assert_eq!(tokenize(tok, &ERNIE_TEMPLATE, "").ids, [BOS_TOKEN]);
    }
}
