//! Host-side f32 tensors: latents, noise, conditioning, decoded images.
//!
//! Shapes are in ggml order (`ne[0]` fastest), so a latent is `[W, H, C, N]` and maps onto
//! a ggml tensor without reordering.

use crate::error::Result;

#[derive(Clone, Debug, PartialEq, Default)]
pub struct Tensor {
    shape: Vec<usize>,
    data: Vec<f32>,
}

impl Tensor {
    pub fn zeros(shape: &[usize]) -> Tensor {
        Tensor { shape: shape.to_vec(), data: vec![0.0; shape.iter().product()] }
    }

    pub fn full(shape: &[usize], value: f32) -> Tensor {
        Tensor { shape: shape.to_vec(), data: vec![value; shape.iter().product()] }
    }

    pub fn from_vec(shape: &[usize], data: Vec<f32>) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        ensure!(n == data.len(), "tensor shape {:?} needs {} values, got {}", shape, n, data.len());
        Ok(Tensor { shape: shape.to_vec(), data })
    }

    /// A tensor of the same shape with every element mapped by `f`.
    pub fn map(&self, f: impl Fn(f32) -> f32) -> Tensor {
        Tensor { shape: self.shape.clone(), data: self.data.iter().map(|&v| f(v)).collect() }
    }

    /// Elementwise combination of two same-shaped tensors.
    pub fn zip(&self, other: &Tensor, f: impl Fn(f32, f32) -> f32) -> Tensor {
        assert_eq!(self.shape, other.shape, "zip of differently shaped tensors");
        Tensor {
            shape: self.shape.clone(),
            data: self.data.iter().zip(&other.data).map(|(&a, &b)| f(a, b)).collect(),
        }
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Size of dimension `i` in ggml order; 1 beyond the tensor's rank.
    pub fn ne(&self, i: usize) -> usize {
        self.shape.get(i).copied().unwrap_or(1)
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn data(&self) -> &[f32] {
        &self.data
    }

    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }

    pub fn into_data(self) -> Vec<f32> {
        self.data
    }

    pub fn reshape(mut self, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        ensure!(n == self.data.len(), "cannot reshape {:?} to {:?}", self.shape, shape);
        self.shape = shape.to_vec();
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_checks() {
        assert!(Tensor::from_vec(&[2, 2], vec![1.0; 3]).is_err());
        let t = Tensor::full(&[4, 2], 1.5);
        assert_eq!(t.ne(0), 4);
        assert_eq!(t.ne(3), 1);
        let u = t.zip(&t.map(|v| v * 2.0), |a, b| a + b);
        assert_eq!(u.data()[0], 4.5);
    }
}
