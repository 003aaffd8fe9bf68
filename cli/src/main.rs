fn main() {
    println!("sd-cli {} ({})", stable_diffusion::api::version(), stable_diffusion::api::commit());
}
