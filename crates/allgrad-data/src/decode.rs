//! Decoding an encoded image (JPEG, PNG, WebP) held in memory into an 8-bit [`Image`] with the
//! channels a [`ColorMode`] asks for.
//!
//! JPEGs (recognised by their first bytes `FF D8 FF`, whatever the file is called) go to
//! zune-jpeg, in strict mode: a file cut short or with a corrupt entropy-coded stream is an
//! error, where a lenient decoder would return an image half filled with grey. Other formats
//! (PNG, and WebP, lossless or lossy, as img2dataset can write them) go to the `image` crate;
//! an image with an alpha channel keeps its colour channels (the alpha is dropped, as Pillow's
//! `convert("RGB")` drops it). zune-jpeg decodes with SIMD IDCT and colour conversion and
//! writes RGB straight into the buffer the [`Image`] keeps; it is the slowest stage of the
//! loader for ImageNet-sized files (docs/data.md), so its speed is the loader's.
//!
//! [`decode_image_shrunk`] decodes a JPEG at 1/2, 1/4 or 1/8 of its size when the views need
//! no more (the loader's `scaled_decode`): the inverse DCT of each 8x8 block then produces
//! 4x4, 2x2 or 1x1 pixels, which skips most of the decoder's work, as Pillow's `draft`,
//! libjpeg-turbo's scaled decode and FFCV do. zune-jpeg has no scaled inverse DCT, so those
//! decodes go to jpeg-decoder (the `image` crate's JPEG decoder, a well-kept crate already in
//! the build) after zune-jpeg has read the headers; a file cut short is refused by the same
//! end-marker check, and jpeg-decoder stops at a corrupt entropy-coded stream.

use std::cell::Cell;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

use crate::error::{DataError, DataResult};
use crate::image::{Decoded, Image};

/// How decoded images are converted to the 1 or 3 channels of an [`Image`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ColorMode {
    /// Every image as RGB (grayscale files are replicated to three channels).
    #[default]
    Rgb,
    /// Every image as one luma channel (computed by the `image` crate, Rec. 709 weights).
    Gray,
    /// RGB for colour files, one channel for grayscale files. A batch needs equal shapes, so
    /// use this only when all files agree.
    Auto,
}

/// Whether `bytes` start like a JPEG file (SOI marker, then another marker).
pub fn is_jpeg(bytes: &[u8]) -> bool {
    bytes.len() >= 3 && bytes[0] == 0xFF && bytes[1] == 0xD8 && bytes[2] == 0xFF
}

/// Images [`decode_image`] was asked to decode, by this process.
static DECODES: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Images [`decode_image`] was asked to decode, by this thread.
    static DECODES_HERE: Cell<u64> = const { Cell::new(0) };
}

/// How many images [`decode_image`] (every decode of an encoded file in the crate) was asked
/// to decode: `(by this process, by the calling thread)`. What a test of where decoding happens
/// reads (none on a training thread whose loader decodes on its workers; one per sample).
pub fn decode_counts() -> (u64, u64) {
    (DECODES.load(Ordering::Relaxed), DECODES_HERE.with(|c| c.get()))
}

/// Decodes `bytes` (a whole JPEG, PNG or WebP file) into 1 or 3 channels as `color` says; `name`
/// names the source in errors.
pub fn decode_image(bytes: &[u8], color: ColorMode, name: &Path) -> DataResult<Image> {
    DECODES.fetch_add(1, Ordering::Relaxed);
    DECODES_HERE.with(|c| c.set(c.get() + 1));
    if is_jpeg(bytes) {
        decode_jpeg(bytes, color, name)
    } else {
        decode_other(bytes, color, name)
    }
}

/// Whether the JPEG's last scan ends with the end-of-image marker: FF D9 after the last start
/// of scan (FF DA). Inside entropy-coded data every FF byte is followed by 00 or a restart
/// marker, so neither can appear there by chance; a file cut anywhere in its last scan has
/// no FF D9 after that scan's FF DA (an embedded thumbnail's FF D9 comes before it).
fn ends_its_last_scan(bytes: &[u8]) -> bool {
    let last_sos = bytes.windows(2).rposition(|w| w == [0xFF, 0xDA]);
    let Some(sos) = last_sos else { return false };
    bytes[sos..].windows(2).any(|w| w == [0xFF, 0xD9])
}

/// Decodes `bytes` as [`decode_image`] does, but a JPEG at 1/`s` of its size, where `s` is
/// what `shrink(width, height)` answers for the file's size (1, 2, 4 or 8; other answers are
/// taken as the next smaller of these, 0 as 1). Other formats, and JPEGs that jpeg-decoder
/// would not give as RGB or gray (CMYK, 12-bit), are decoded at full size (`shrink` 1 in the
/// result).
pub fn decode_image_shrunk(
    bytes: &[u8],
    color: ColorMode,
    name: &Path,
    shrink: &dyn Fn(usize, usize) -> usize,
) -> DataResult<Decoded> {
    DECODES.fetch_add(1, Ordering::Relaxed);
    DECODES_HERE.with(|c| c.set(c.get() + 1));
    if !is_jpeg(bytes) {
        return decode_other(bytes, color, name).map(Decoded::whole);
    }
    let mut shrink = |w: usize, h: usize| [8, 4, 2, 1].into_iter().find(|&s| s <= shrink(w, h)).unwrap_or(1);
    jpeg_at(bytes, color, name, &mut shrink)
}

fn decode_jpeg(bytes: &[u8], color: ColorMode, name: &Path) -> DataResult<Image> {
    Ok(jpeg_at(bytes, color, name, &mut |_, _| 1)?.image)
}

fn jpeg_at(bytes: &[u8], color: ColorMode, name: &Path, shrink: &mut dyn FnMut(usize, usize) -> usize) -> DataResult<Decoded> {
    let err = |source| DataError::Jpeg { path: name.into(), source };
    // zune-jpeg decodes a file cut in its last bytes of padding without complaint (the
    // pixels are all there); a file without its end marker is refused anyway, as cut short.
    if !ends_its_last_scan(bytes) {
        return Err(err(zune_jpeg::errors::DecodeErrors::FormatStatic(
            "no end-of-image marker after the last scan: the file is cut short",
        )));
    }
    let options = DecoderOptions::default().set_strict_mode(true).jpeg_set_out_colorspace(ColorSpace::RGB);
    let mut decoder = JpegDecoder::new_with_options(ZCursor::new(bytes), options);
    decoder.decode_headers().map_err(err)?;
    let gray_file = matches!(decoder.input_colorspace(), Some(ColorSpace::Luma | ColorSpace::LumaA));
    let (width, height) = decoder.dimensions().unwrap_or((0, 0));
    let s = if width > 0 && height > 0 { shrink(width, height) } else { 1 };
    if s > 1 {
        if let Some(image) = jpeg_scaled(bytes, color, name, (width, height), s)? {
            return Ok(Decoded { image, full: (width, height), shrink: s });
        }
    }
    let image = jpeg_full(bytes, color, name, decoder, options, gray_file, (width, height))?;
    Ok(Decoded::whole(image))
}

/// A JPEG of `full` size decoded at 1/`s` by jpeg-decoder's scaled inverse DCT; `None` for a
/// file it would give in another pixel format than gray or RGB (decoded at full size then).
fn jpeg_scaled(bytes: &[u8], color: ColorMode, name: &Path, full: (usize, usize), s: usize) -> DataResult<Option<Image>> {
    let err = |e: jpeg_decoder::Error| DataError::Jpeg {
        path: name.into(),
        source: zune_jpeg::errors::DecodeErrors::Format(format!("scaled decode at 1/{s}: {e}")),
    };
    let (w, h) = (full.0.div_ceil(s), full.1.div_ceil(s));
    let mut decoder = jpeg_decoder::Decoder::new(bytes);
    // Sizes come from the file's 16-bit header fields, so they fit.
    let got = decoder.scale(w as u16, h as u16).map_err(err)?;
    if (got.0 as usize, got.1 as usize) != (w, h) {
        return Ok(None);
    }
    let format = decoder.info().map(|i| i.pixel_format);
    let channels = match format {
        Some(jpeg_decoder::PixelFormat::L8) => 1,
        Some(jpeg_decoder::PixelFormat::RGB24) => 3,
        _ => return Ok(None),
    };
    let pixels = decoder.decode().map_err(err)?;
    let img = Image::new(w, h, channels, pixels)?;
    // As the full decode converts: gray files replicated to RGB, colour to one channel by the
    // crate's one gray conversion.
    match color {
        ColorMode::Rgb => img.to_channels(3).map(Some),
        ColorMode::Gray => img.to_channels(1).map(Some),
        ColorMode::Auto => Ok(Some(img)),
    }
}

fn jpeg_full(
    bytes: &[u8],
    color: ColorMode,
    name: &Path,
    mut decoder: JpegDecoder<ZCursor<&[u8]>>,
    options: DecoderOptions,
    gray_file: bool,
    (width, height): (usize, usize),
) -> DataResult<Image> {
    let err = |source| DataError::Jpeg { path: name.into(), source };
    let rgb_out = match color {
        ColorMode::Rgb => true,
        ColorMode::Gray => false,
        ColorMode::Auto => !gray_file,
    };
    if !rgb_out && gray_file {
        // A grayscale file to one channel: its samples as they are.
        let options = options.jpeg_set_out_colorspace(ColorSpace::Luma);
        let mut decoder = JpegDecoder::new_with_options(ZCursor::new(bytes), options);
        let pixels = decoder.decode().map_err(err)?;
        return Image::new(width, height, 1, pixels);
    }
    let pixels = decoder.decode().map_err(err)?;
    let rgb = Image::new(width, height, 3, pixels)?;
    if rgb_out {
        return Ok(rgb);
    }
    // One channel from a colour file: the crate's one gray conversion, as for PNG.
    rgb.to_channels(1)
}

fn decode_other(bytes: &[u8], color: ColorMode, name: &Path) -> DataResult<Image> {
    let reader = image::io::Reader::new(std::io::Cursor::new(bytes));
    let reader = reader.with_guessed_format().map_err(|e| DataError::io(name, e))?;
    let img = reader.decode().map_err(|source| DataError::Decode { path: name.into(), source })?;
    let rgb = match color {
        ColorMode::Rgb => true,
        ColorMode::Gray => false,
        ColorMode::Auto => img.color().has_color(),
    };
    let (width, height) = (img.width() as usize, img.height() as usize);
    Ok(if rgb {
        Image { width, height, channels: 3, pixels: img.to_rgb8().into_raw() }
    } else {
        Image { width, height, channels: 1, pixels: img.to_luma8().into_raw() }
    })
}
