//! MJPEG AVI files (what the reference writes for a video) and WAV sidecars.
//!
//! The layout is the reference's: RIFF 'AVI ' with an `hdrl` list (main header, one video
//! stream 'vids'/'MJPG' and, with audio, one 16-bit PCM stream 'auds'), a `movi` list with
//! one `00dc` chunk per frame (a JPEG at quality 90, padded to an even size) and, with
//! audio, a single `01wb` chunk after them, then an `idx1` index whose offsets count from
//! the start of the file (as the reference writes them; players accept both conventions).
//! `read` parses such a file back, for the tests and for checking what was written.

use std::path::Path;

use stable_diffusion::api::{Audio, Image};

use crate::image_io::write_atomically;
use crate::jpeg;

/// AVIF_HASINDEX | AVIF_ISINTERLEAVED.
const MAIN_FLAGS: u32 = 0x110;
/// AVIIF_KEYFRAME: every MJPEG frame is one.
const KEYFRAME: u32 = 0x10;

fn u16le(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn u32le(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn patch(out: &mut [u8], at: usize, v: u32) {
    out[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// The samples as 16-bit PCM, clamped to [-1, 1] and rounded to nearest (ties to even, as
/// C's `lrint` does).
pub fn pcm16(samples: &[f32]) -> Vec<u8> {
    samples.iter().flat_map(|&s| ((s.clamp(-1.0, 1.0) * 32767.0).round_ties_even() as i16).to_le_bytes()).collect()
}

/// True when `audio` has something to play (the reference ignores empty tracks).
fn playable(audio: Option<&Audio>) -> Option<&Audio> {
    audio.filter(|a| a.sample_rate > 0 && a.channels > 0 && !a.data.is_empty() && a.data.len() >= a.channels as usize)
}

fn size_u32(n: usize, what: &str) -> Result<u32, String> {
    u32::try_from(n).map_err(|_| format!("{what} is too large for an AVI file ({n} bytes)"))
}

/// An MJPEG AVI of `frames` at `fps` frames per second, with `audio` muxed in when given.
/// Every frame must have the first frame's size and 3 or 4 channels (alpha is dropped).
pub fn encode(frames: &[Image], fps: i32, audio: Option<&Audio>) -> Result<Vec<u8>, String> {
    let first = frames.first().ok_or("no frame to write")?;
    if fps <= 0 {
        return Err(format!("fps must be positive to write a video, got {fps}"));
    }
    if !matches!(first.channels, 3 | 4) {
        return Err(format!("video frames must have 3 or 4 channels, got {}", first.channels));
    }
    if let Some((i, f)) = frames.iter().enumerate().find(|(_, f)| (f.width, f.height, f.channels) != (first.width, first.height, first.channels)) {
        return Err(format!(
            "frame {i} is {}x{}x{}, frame 0 is {}x{}x{}: every frame of a video must have the same size",
            f.width, f.height, f.channels, first.width, first.height, first.channels
        ));
    }
    let (w, h) = (first.width, first.height);
    let frame_bytes = w.checked_mul(h).and_then(|n| n.checked_mul(3)).ok_or("frames too large for an AVI file")?;
    let count = size_u32(frames.len(), "the frame count")?;
    let audio = playable(audio);
    let pcm = audio.map(|a| pcm16(&a.data)).unwrap_or_default();
    let (block_align, byte_rate) = match audio {
        Some(a) => {
            let align = u16::try_from(a.channels * 2).map_err(|_| format!("{} audio channels are too many", a.channels))?;
            (align, a.sample_rate.checked_mul(u32::from(align)).ok_or("audio sample rate too large")?)
        }
        None => (0, 0),
    };
    let audio_len = size_u32(pcm.len(), "the audio track")?;

    let mut out = Vec::with_capacity(frames.len() * (frame_bytes as usize / 8 + 64) + 4096);
    out.extend_from_slice(b"RIFF");
    let riff_size_at = out.len();
    u32le(&mut out, 0);
    out.extend_from_slice(b"AVI ");

    // Header list: 'hdrl', avih (56), then a stream list per stream.
    let video_strl = 4 + (8 + 56) + (8 + 40);
    let audio_strl = 4 + (8 + 56) + (8 + 16);
    out.extend_from_slice(b"LIST");
    u32le(&mut out, 4 + (8 + 56) + (8 + video_strl) + if audio.is_some() { 8 + audio_strl } else { 0 });
    out.extend_from_slice(b"hdrl");
    out.extend_from_slice(b"avih");
    u32le(&mut out, 56);
    for v in [1_000_000 / fps as u32, 0, 0, MAIN_FLAGS, count, 0, if audio.is_some() { 2 } else { 1 }, frame_bytes, w, h, 0, 0, 0, 0] {
        u32le(&mut out, v);
    }

    out.extend_from_slice(b"LIST");
    u32le(&mut out, video_strl);
    out.extend_from_slice(b"strl");
    out.extend_from_slice(b"strh");
    u32le(&mut out, 56);
    out.extend_from_slice(b"vidsMJPG");
    u32le(&mut out, 0); // flags
    u16le(&mut out, 0); // priority
    u16le(&mut out, 0); // language
    for v in [0, 1, fps as u32, 0, count, frame_bytes, u32::MAX, 0] {
        // initial frames, scale, rate, start, length, buffer size, quality (default), sample size
        u32le(&mut out, v);
    }
    for _ in 0..4 {
        u16le(&mut out, 0); // rcFrame
    }
    out.extend_from_slice(b"strf");
    u32le(&mut out, 40);
    u32le(&mut out, 40);
    u32le(&mut out, w);
    u32le(&mut out, h);
    u16le(&mut out, 1); // planes
    u16le(&mut out, 24); // bits per pixel
    out.extend_from_slice(b"MJPG");
    for v in [frame_bytes, 0, 0, 0, 0] {
        u32le(&mut out, v);
    }

    if let Some(a) = audio {
        out.extend_from_slice(b"LIST");
        u32le(&mut out, audio_strl);
        out.extend_from_slice(b"strl");
        out.extend_from_slice(b"strh");
        u32le(&mut out, 56);
        out.extend_from_slice(b"auds");
        u32le(&mut out, 0); // handler
        u32le(&mut out, 0); // flags
        u16le(&mut out, 0);
        u16le(&mut out, 0);
        let samples = size_u32(a.data.len() / a.channels as usize, "the audio sample count")?;
        for v in [0, u32::from(block_align), byte_rate, 0, samples, audio_len, u32::MAX, u32::from(block_align)] {
            u32le(&mut out, v);
        }
        for _ in 0..4 {
            u16le(&mut out, 0);
        }
        out.extend_from_slice(b"strf");
        u32le(&mut out, 16);
        u16le(&mut out, 1); // PCM
        u16le(&mut out, a.channels as u16);
        u32le(&mut out, a.sample_rate);
        u32le(&mut out, byte_rate);
        u16le(&mut out, block_align);
        u16le(&mut out, 16);
    }

    out.extend_from_slice(b"LIST");
    let movi_size_at = out.len();
    u32le(&mut out, 0);
    out.extend_from_slice(b"movi");
    let mut index: Vec<([u8; 4], u32, u32, u32)> = Vec::with_capacity(frames.len() + 1);
    let mut chunk = |out: &mut Vec<u8>, id: &[u8; 4], flags: u32, body: &[u8]| -> Result<(), String> {
        let offset = size_u32(out.len(), "the video")?;
        let len = size_u32(body.len(), "a frame")?;
        out.extend_from_slice(id);
        u32le(out, len);
        out.extend_from_slice(body);
        if body.len() % 2 == 1 {
            out.push(0);
        }
        index.push((*id, flags, offset, len));
        Ok(())
    };
    for (i, frame) in frames.iter().enumerate() {
        let jpeg = jpeg::encode(frame, jpeg::REFERENCE_QUALITY, "").map_err(|e| format!("frame {i}: {e}"))?;
        chunk(&mut out, b"00dc", KEYFRAME, &jpeg)?;
    }
    if !pcm.is_empty() {
        chunk(&mut out, b"01wb", 0, &pcm)?;
    }
    let movi_size = size_u32(out.len() - movi_size_at - 4, "the video")?;
    patch(&mut out, movi_size_at, movi_size);

    out.extend_from_slice(b"idx1");
    u32le(&mut out, size_u32(index.len() * 16, "the index")?);
    for (id, flags, offset, len) in &index {
        out.extend_from_slice(id);
        for v in [*flags, *offset, *len] {
            u32le(&mut out, v);
        }
    }
    let riff_size = size_u32(out.len() - riff_size_at - 4, "the video")?;
    patch(&mut out, riff_size_at, riff_size);
    Ok(out)
}

/// Encodes and writes an MJPEG AVI (through a temporary file).
pub fn write(path: &Path, frames: &[Image], fps: i32, audio: Option<&Audio>) -> Result<(), String> {
    let bytes = encode(frames, fps, audio)?;
    write_atomically(path, &bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// A 16-bit PCM WAV file of `audio`.
pub fn encode_wav(audio: &Audio) -> Result<Vec<u8>, String> {
    let audio = playable(Some(audio)).ok_or("the audio track is empty")?;
    let pcm = pcm16(&audio.data);
    let data_len = size_u32(pcm.len(), "the audio track")?;
    let align = u16::try_from(audio.channels * 2).map_err(|_| format!("{} audio channels are too many", audio.channels))?;
    let mut out = Vec::with_capacity(44 + pcm.len());
    out.extend_from_slice(b"RIFF");
    u32le(&mut out, data_len.checked_add(36).ok_or("the audio track is too large for a WAV file")?);
    out.extend_from_slice(b"WAVEfmt ");
    u32le(&mut out, 16);
    u16le(&mut out, 1);
    u16le(&mut out, align / 2);
    u32le(&mut out, audio.sample_rate);
    u32le(&mut out, audio.sample_rate.wrapping_mul(u32::from(align)));
    u16le(&mut out, align);
    u16le(&mut out, 16);
    out.extend_from_slice(b"data");
    u32le(&mut out, data_len);
    out.extend_from_slice(&pcm);
    Ok(out)
}

/// Writes `audio` as a WAV file (through a temporary file).
pub fn write_wav(path: &Path, audio: &Audio) -> Result<(), String> {
    let bytes = encode_wav(audio)?;
    write_atomically(path, &bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// The largest WAV data chunk read (bytes).
const MAX_WAV_BYTES: usize = 1 << 30;

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// Reads a WAV file as the reference does: integer PCM of 8, 16, 24 or 32 bits or float
/// samples of 32 or 64 bits (WAVE_FORMAT_EXTENSIBLE too), scaled to [-1, 1), interleaved.
pub fn read_wav(path: &Path) -> Result<Audio, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("load WAV audio from '{}' failed: {e}", path.display()))?;
    decode_wav(&bytes).map_err(|e| format!("load WAV audio from '{}' failed: {e}", path.display()))
}

/// Decodes the bytes of a WAV file (see `read_wav`).
pub fn decode_wav(b: &[u8]) -> Result<Audio, String> {
    if b.get(0..4) != Some(b"RIFF") || b.get(8..12) != Some(b"WAVE") {
        return Err("not a RIFF WAVE file".into());
    }
    let (mut format, mut channels, mut rate, mut align, mut bits) = (0u16, 0u16, 0u32, 0u16, 0u16);
    let mut data: Option<&[u8]> = None;
    let mut at = 12;
    while at + 8 <= b.len() {
        let len = le32(b, at + 4)? as usize;
        let body = &b[at + 8..(at + 8).saturating_add(len).min(b.len())];
        match &b[at..at + 4] {
            b"fmt " => {
                if len < 16 || body.len() < 16 {
                    return Err("short fmt chunk".into());
                }
                format = le16(body, 0);
                channels = le16(body, 2);
                rate = le32(body, 4)?;
                align = le16(body, 12);
                bits = le16(body, 14);
                if format == 0xfffe && body.len() >= 40 {
                    format = le16(body, 24);
                }
            }
            b"data" => data = Some(body),
            _ => {}
        }
        at = at.saturating_add(8).saturating_add(len).saturating_add(len % 2);
    }
    let data = data.filter(|d| !d.is_empty()).ok_or("no audio data")?;
    if data.len() > MAX_WAV_BYTES {
        return Err(format!("{} bytes of audio are more than this sd-cli reads ({MAX_WAV_BYTES})", data.len()));
    }
    let size = usize::from(bits).div_ceil(8);
    let (channels_n, align_n) = (usize::from(channels), usize::from(align));
    if channels == 0 || rate == 0 || size == 0 || align_n < channels_n * size || !matches!(format, 1 | 3) {
        return Err(format!("unsupported WAV format (format {format}, {channels} channels, {rate} Hz, {bits} bits, block {align})"));
    }
    let sample = |s: &[u8]| -> Option<f32> {
        Some(match (format, bits) {
            (3, 32) => f32::from_le_bytes(s[..4].try_into().ok()?),
            (3, 64) => f64::from_le_bytes(s[..8].try_into().ok()?) as f32,
            (1, 8) => (i32::from(s[0]) - 128) as f32 / 128.0,
            (1, 16) => f32::from(i16::from_le_bytes([s[0], s[1]])) / 32768.0,
            (1, 24) => ((i32::from(s[0]) | (i32::from(s[1]) << 8) | (i32::from(s[2]) << 16)) << 8 >> 8) as f32 / 8_388_608.0,
            (1, 32) => i32::from_le_bytes(s[..4].try_into().ok()?) as f32 / 2_147_483_648.0,
            _ => return None,
        })
    };
    let mut out = Vec::with_capacity(data.len() / align_n * channels_n);
    for block in data.chunks_exact(align_n) {
        for ch in 0..channels_n {
            let s = &block[ch * size..(ch + 1) * size];
            out.push(sample(s).ok_or_else(|| format!("unsupported WAV sample format (format {format}, {bits} bits)"))?);
        }
    }
    if out.is_empty() {
        return Err("no complete audio frame".into());
    }
    Ok(Audio { sample_rate: rate, channels: u32::from(channels), data: out })
}

/// What `read` finds in an AVI file.
#[derive(Debug, Clone, PartialEq)]
pub struct AviInfo {
    pub width: u32,
    pub height: u32,
    /// Frame rate from the video stream header (rate / scale).
    pub fps: u32,
    pub micro_sec_per_frame: u32,
    /// Frame count of the main header.
    pub total_frames: u32,
    pub streams: u32,
    /// The `00dc` chunk bodies (JPEG files), in order.
    pub frames: Vec<Vec<u8>>,
    /// The `01wb` chunk body (16-bit PCM), if any.
    pub audio: Option<Vec<u8>>,
    /// (chunk id, flags, offset from the file start, size) of each idx1 entry.
    pub index: Vec<([u8; 4], u32, u32, u32)>,
}

fn le32(b: &[u8], at: usize) -> Result<u32, String> {
    b.get(at..at + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]])).ok_or_else(|| format!("truncated at byte {at}"))
}

/// Parses an AVI file written by `encode`, checking its sizes: the RIFF size is the file's,
/// every list's size covers its chunks exactly, and each index entry points at a chunk
/// header with its id and size.
pub fn read(bytes: &[u8]) -> Result<AviInfo, String> {
    if bytes.get(0..4) != Some(b"RIFF") || bytes.get(8..12) != Some(b"AVI ") {
        return Err("not a RIFF AVI file".into());
    }
    if le32(bytes, 4)? as usize != bytes.len() - 8 {
        return Err(format!("RIFF size {} but the file has {} bytes after it", le32(bytes, 4)?, bytes.len() - 8));
    }
    let mut info = AviInfo { width: 0, height: 0, fps: 0, micro_sec_per_frame: 0, total_frames: 0, streams: 0, frames: Vec::new(), audio: None, index: Vec::new() };
    // Walks the chunks of bytes[start..end]; lists are entered.
    fn walk(b: &[u8], start: usize, end: usize, info: &mut AviInfo, in_movi: bool) -> Result<(), String> {
        let mut at = start;
        let mut stream_kind: Option<[u8; 4]> = None;
        while at < end {
            let id: [u8; 4] = b.get(at..at + 4).ok_or("truncated chunk id")?.try_into().map_err(|_| "chunk id")?;
            let len = le32(b, at + 4)? as usize;
            let body = at + 8;
            let body_end = body.checked_add(len).filter(|&e| e <= end).ok_or_else(|| format!("chunk {} at {at} overruns its list", String::from_utf8_lossy(&id)))?;
            match &id {
                b"LIST" => {
                    let kind = b.get(body..body + 4).ok_or("truncated list")?;
                    walk(b, body + 4, body_end, info, kind == b"movi")?;
                }
                b"avih" => {
                    info.micro_sec_per_frame = le32(b, body)?;
                    info.total_frames = le32(b, body + 16)?;
                    info.streams = le32(b, body + 24)?;
                    info.width = le32(b, body + 32)?;
                    info.height = le32(b, body + 36)?;
                }
                b"strh" => {
                    let kind: [u8; 4] = b[body..body + 4].try_into().map_err(|_| "strh")?;
                    if &kind == b"vids" {
                        let (scale, rate) = (le32(b, body + 20)?, le32(b, body + 24)?);
                        info.fps = if scale == 0 { 0 } else { rate / scale };
                    }
                    stream_kind = Some(kind);
                }
                b"strf" => {
                    if stream_kind == Some(*b"vids") && b.get(body + 16..body + 20) != Some(b"MJPG") {
                        return Err("the video stream is not MJPG".into());
                    }
                }
                b"00dc" if in_movi => info.frames.push(b[body..body_end].to_vec()),
                b"01wb" if in_movi => info.audio = Some(b[body..body_end].to_vec()),
                b"idx1" => {
                    for e in b[body..body_end].chunks(16) {
                        let id: [u8; 4] = e.get(0..4).ok_or("short index entry")?.try_into().map_err(|_| "index")?;
                        info.index.push((id, le32(e, 4)?, le32(e, 8)?, le32(e, 12)?));
                    }
                }
                _ => {}
            }
            at = body_end + len % 2;
        }
        Ok(())
    }
    walk(bytes, 12, bytes.len(), &mut info, false)?;
    for (id, _, offset, len) in &info.index {
        let at = *offset as usize;
        if bytes.get(at..at + 4) != Some(&id[..]) || le32(bytes, at + 4)? != *len {
            return Err(format!("index entry {} at {offset} does not point at its chunk", String::from_utf8_lossy(id)));
        }
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pcm_rounds_like_lrint_and_clamps() {
        let b = pcm16(&[0.0, 1.0, -1.0, 2.0, -3.0, 0.5 / 32767.0, 1.5 / 32767.0]);
        let v: Vec<i16> = b.chunks(2).map(|c| i16::from_le_bytes([c[0], c[1]])).collect();
        assert_eq!(v, vec![0, 32767, -32767, 32767, -32767, 0, 2]);
    }

    #[test]
    fn wav_header() {
        let a = Audio { sample_rate: 8000, channels: 2, data: vec![0.0, 0.5, -0.5, 1.0] };
        let w = encode_wav(&a).unwrap();
        assert_eq!(w.len(), 44 + 8);
        assert_eq!(&w[0..4], b"RIFF");
        assert_eq!(le32(&w, 4).unwrap(), 36 + 8);
        assert_eq!(le32(&w, 24).unwrap(), 8000);
        assert_eq!(le32(&w, 28).unwrap(), 32000);
        assert_eq!(le32(&w, 40).unwrap(), 8);
        assert!(encode_wav(&Audio { sample_rate: 8000, channels: 1, data: vec![] }).is_err());
        // Read back: 16-bit PCM scaled by 1/32768.
        let back = decode_wav(&w).unwrap();
        assert_eq!((back.sample_rate, back.channels), (8000, 2));
        assert_eq!(back.data, vec![0.0, 16384.0 / 32768.0, -16384.0 / 32768.0, 32767.0 / 32768.0]);
    }

    #[test]
    fn wav_sample_formats() {
        let wav = |format: u16, channels: u16, bits: u16, data: &[u8]| {
            let align = channels * bits.div_ceil(8);
            let mut b = b"RIFF\0\0\0\0WAVEfmt ".to_vec();
            u32le(&mut b, 16);
            for v in [format, channels] {
                u16le(&mut b, v);
            }
            u32le(&mut b, 1000);
            u32le(&mut b, 1000 * u32::from(align));
            u16le(&mut b, align);
            u16le(&mut b, bits);
            b.extend_from_slice(b"LIST");
            u32le(&mut b, 3);
            b.extend_from_slice(b"abc\0");
            b.extend_from_slice(b"data");
            u32le(&mut b, data.len() as u32);
            b.extend_from_slice(data);
            decode_wav(&b)
        };
        assert_eq!(wav(1, 1, 8, &[0, 128, 255]).unwrap().data, vec![-1.0, 0.0, 127.0 / 128.0]);
        assert_eq!(wav(1, 1, 24, &[0, 0, 0x80, 0xff, 0xff, 0x7f]).unwrap().data, vec![-1.0, 8_388_607.0 / 8_388_608.0]);
        assert_eq!(wav(1, 1, 32, &i32::MIN.to_le_bytes()).unwrap().data, vec![-1.0]);
        assert_eq!(wav(3, 2, 32, &[0.25f32.to_le_bytes(), (-0.5f32).to_le_bytes()].concat()).unwrap().data, vec![0.25, -0.5]);
        assert_eq!(wav(3, 1, 64, &0.125f64.to_le_bytes()).unwrap().data, vec![0.125]);
        assert!(wav(2, 1, 16, &[0, 0]).is_err());
        assert!(wav(1, 1, 12, &[0, 0]).is_err());
        assert!(wav(1, 0, 16, &[0, 0]).is_err());
        assert!(wav(1, 1, 16, &[]).is_err());
        assert!(decode_wav(b"RIFF\0\0\0\0WAVE").is_err());
    }

    #[test]
    fn refuses_what_it_cannot_write() {
        let f = |w, h, c| Image { width: w, height: h, channels: c, data: vec![9; (w * h * c) as usize] };
        assert!(encode(&[], 16, None).is_err());
        assert!(encode(&[f(8, 8, 3)], 0, None).unwrap_err().contains("fps"));
        assert!(encode(&[f(8, 8, 1)], 16, None).unwrap_err().contains("channels"));
        assert!(encode(&[f(8, 8, 3), f(8, 16, 3)], 16, None).unwrap_err().contains("frame 1"));
        assert!(read(b"RIFF\0\0\0\0WAVE").is_err());
    }
}
