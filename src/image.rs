//! 8-bit images as the C API exchanges them (interleaved channels, row-major).

#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Image {
    pub width: u32,
    pub height: u32,
    pub channels: u32,
    pub data: Vec<u8>,
}

impl Image {
    pub fn new(width: u32, height: u32, channels: u32, data: Vec<u8>) -> Option<Image> {
        let n = (width as usize).checked_mul(height as usize)?.checked_mul(channels as usize)?;
        (n == data.len()).then_some(Image { width, height, channels, data })
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}
