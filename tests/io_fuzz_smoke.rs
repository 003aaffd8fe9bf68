//! The fuzz targets' entry points over the committed seed corpus and a few thousand
//! deterministic mutations of it: runs with plain `cargo test`, no libFuzzer needed.

use stable_diffusion::io::fuzzing;
use std::path::PathBuf;

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus")).join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    files.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

/// xorshift64*: deterministic, dependency-free.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut d = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        if d.is_empty() {
            d.push(0);
        }
        let at = rng.below(d.len());
        match rng.below(7) {
            0 => d[at] ^= 1 << rng.below(8),
            1 => d[at] = [0, 0xff, 0x7f, 0x80, 1, b'.', b'(', b'}'][rng.below(8)],
            2 => d.truncate(at),
            3 => {
                let v = [u64::MAX, 1 << 40, i64::MAX as u64, 0x8000_0000, 0][rng.below(5)].to_le_bytes();
                let n = 8.min(d.len() - at);
                d[at..at + n].copy_from_slice(&v[..n]);
            }
            4 => {
                let end = (at + 1 + rng.below(64)).min(d.len());
                let chunk = d[at..end].to_vec();
                let to = rng.below(d.len());
                d.splice(to..to, chunk);
            }
            5 => {
                let end = (at + 1 + rng.below(32)).min(d.len());
                d.drain(at..end);
            }
            _ => {
                let a = rng.below(d.len());
                d.swap(at, a);
            }
        }
    }
    d
}

fn run(target: &str, f: fn(&[u8]), rounds: usize) {
    let seeds = seeds(target);
    assert!(!seeds.is_empty(), "no seeds for {target}");
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ target.len() as u64);
    for s in &seeds {
        f(s);
        fuzzing::any_bytes(s);
        for _ in 0..rounds {
            let m = mutate(&mut rng, s);
            f(&m);
        }
    }
}

#[test]
fn safetensors_seeds_and_mutations() {
    run("safetensors", fuzzing::safetensors_bytes, 1500);
}

#[test]
fn gguf_seeds_and_mutations() {
    run("gguf", fuzzing::gguf_bytes, 1500);
}

#[test]
fn pickle_seeds_and_mutations() {
    run("pickle", fuzzing::pickle_bytes, 1500);
}

#[test]
fn torch_zip_seeds_and_mutations() {
    run("torch_zip", fuzzing::torch_zip_bytes, 800);
}

#[test]
fn torch_legacy_seeds_and_mutations() {
    run("torch_legacy", fuzzing::torch_legacy_bytes, 1500);
}
