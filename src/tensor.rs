//! Host-side f32 tensors: latents, noise, conditioning, decoded images.
//!
//! Shapes are in ggml order (`ne[0]` fastest), so a latent is `[W, H, C, N]` and maps onto
//! a ggml tensor without reordering.

use crate::error::{Context, Result};

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

    /// `parts` of one shape stacked along `dim`, which must be their outermost dimension of
    /// size 1 (a batch of one): `[W, H, C, 1]` items make `[W, H, C, n]`.
    pub fn stack(parts: &[&Tensor], dim: usize) -> Result<Tensor> {
        let first: &Tensor = parts.first().copied().context("stacking no tensors")?;
        let rank = first.shape.len().max(dim + 1);
        ensure!(
            (dim..rank).all(|d| first.ne(d) == 1),
            "cannot stack {:?} along dimension {dim}: it is not an outer dimension of size 1",
            first.shape
        );
        let mut shape: Vec<usize> = (0..dim).map(|d| first.ne(d)).collect();
        shape.push(parts.len());
        let mut data = Vec::with_capacity(first.len() * parts.len());
        for &p in parts {
            ensure!((0..rank).all(|d| p.ne(d) == first.ne(d)), "cannot stack {:?} with {:?}", p.shape, first.shape);
            data.extend_from_slice(&p.data);
        }
        Ok(Tensor { shape, data })
    }

    /// The items of a batch along the outermost dimension `dim` (the inverse of [`Tensor::stack`]),
    /// each with that dimension 1.
    pub fn unstack(&self, dim: usize) -> Result<Vec<Tensor>> {
        ensure!((dim + 1..self.shape.len()).all(|d| self.ne(d) == 1), "cannot split {:?} along inner dimension {dim}", self.shape);
        let n = self.ne(dim);
        let mut shape: Vec<usize> = (0..dim).map(|d| self.ne(d)).collect();
        shape.push(1);
        let item = shape.iter().product::<usize>();
        Ok((0..n).map(|i| Tensor { shape: shape.clone(), data: self.data[i * item..(i + 1) * item].to_vec() }).collect())
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

    #[test]
    fn stacks_along_an_outer_dimension_and_splits_back() {
        let a = Tensor::from_vec(&[2, 3, 1], (0..6).map(|v| v as f32).collect()).unwrap();
        let b = a.map(|v| -v);
        let s = Tensor::stack(&[&a, &b], 2).unwrap();
        assert_eq!(s.shape(), &[2, 3, 2]);
        assert_eq!(s.data()[6..], b.data()[..]);
        let y = Tensor::stack(&[&Tensor::full(&[5], 1.0), &Tensor::full(&[5], 2.0)], 1).unwrap();
        assert_eq!(y.shape(), &[5, 2]);
        let parts = s.unstack(2).unwrap();
        assert_eq!(parts, vec![a.clone(), b]);
        assert!(Tensor::stack(&[&a, &Tensor::zeros(&[3, 2, 1])], 2).is_err());
        assert!(Tensor::stack(&[&a, &a], 1).is_err());
        assert!(s.unstack(1).is_err());
    }
}
