//! The views of fixed images under the bundled configs' augmentations (and a full RGB
//! recipe), pinned as a hash of their bits: the values of the pipeline as first written (the
//! whole image converted to floats, then each stage on its own copy), which the bundled runs'
//! figures were measured with. The hashes were printed by this test on that code.

use allgrad_data::{Augment, AugmentConfig, Image, ViewKey};

fn fnv(bits: impl IntoIterator<Item = u32>) -> u64 {
    let mut h = 0xcbf29ce484222325u64;
    for b in bits {
        for byte in b.to_le_bytes() {
            h = (h ^ byte as u64).wrapping_mul(0x100000001b3);
        }
    }
    h
}

fn hash(yaml: &str, img: &Image) -> u64 {
    let aug = Augment::new(serde_yaml::from_str::<AugmentConfig>(yaml).unwrap()).unwrap();
    let mut bits = Vec::new();
    for i in 0..64u64 {
        let v = aug.apply(img, ViewKey { seed: 3, epoch: i % 3, index: i, view: i % 2 }).unwrap();
        bits.extend(v.data.iter().map(|x| x.to_bits()));
    }
    fnv(bits)
}

#[test]
fn views_of_the_bundled_recipes_are_pinned() {
    let gray = Image::new(28, 28, 1, (0..784u32).map(|i| ((i * 37 + i / 28 * 11) % 256) as u8).collect()).unwrap();
    let rgb = Image::new(61, 47, 3, (0..61 * 47 * 3u32).map(|i| ((i * 13 + i / 183 * 7) % 256) as u8).collect()).unwrap();
    let simclr = "crop: {size: 28, scale: [0.2, 1.0], ratio: [0.75, 1.3333]}\nflip: {p: 0.5}\ncolor_jitter: {brightness: 0.4, contrast: 0.4, saturation: 0.0, hue: 0.0, p: 0.8}\ngrayscale: {p: 0.0}\nblur: {kernel: 3, sigma: [0.1, 2.0], p: 0.0}\nnormalize: {mean: [0.2860], std: [0.3530]}";
    let face = "crop: {size: 28, scale: [0.5, 1.0], ratio: [0.75, 1.3333]}\nflip: {p: 0.5}\ncolor_jitter: {brightness: 0.3, contrast: 0.3, saturation: 0.0, hue: 0.0, p: 0.5}\ngrayscale: {p: 0.0}\nblur: {kernel: 3, sigma: [0.1, 1.0], p: 0.2}\nnormalize: {mean: [0.5], std: [0.5]}";
    let full = "crop: {size: 24}\ncolor_jitter: {brightness: 0.4, contrast: 0.4, saturation: 0.4, hue: 0.1, p: 0.8}\ngrayscale: {p: 0.2}\nblur: {kernel: 5, sigma: [0.1, 2.0], p: 0.5}\nnormalize: {mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225]}";
    let got = [hash(simclr, &gray), hash(face, &gray), hash(full, &rgb)];
    println!("PINNED {got:?}");
    assert_eq!(got, PINNED);
}

const PINNED: [u64; 3] = [5969653084912806130, 12692048295117717171, 10690540784865882416];
