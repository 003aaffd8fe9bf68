//! Text encoders (conditioning networks), like the reference's `src/model/te/`.

pub mod clip;
#[cfg(test)]
mod test_weights;
