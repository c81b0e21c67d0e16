//! Image-caption pairs: the CSV source (quoting, errors that name the file and the line), the
//! class-caption source (captions fixed per sample and seed, every template and name used).

use std::sync::Arc;

use allgrad_data::{Dataset, Image, InMemory};
use allgrad_models::clip::{ClassCaptions, CsvPairs};

fn png(path: &std::path::Path, w: u32, h: u32) {
    image::GrayImage::from_fn(w, h, |x, y| image::Luma([(x * 10 + y) as u8])).save(path).unwrap();
}

#[test]
fn a_csv_of_pairs_reads_quoted_captions_and_decodes_its_images() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("img")).unwrap();
    png(&d.path().join("img/a.png"), 4, 3);
    png(&d.path().join("img/b.png"), 2, 2);
    let csv = d.path().join("pairs.csv");
    std::fs::write(&csv, "image,caption\nimg/a.png,a plain caption\n\nimg/b.png,\"a boot, \"\"ankle\"\" kind\"\n").unwrap();
    let pairs = CsvPairs::open(&csv).unwrap();
    assert_eq!(pairs.len(), 2);
    assert_eq!(pairs.caption(0).unwrap(), "a plain caption");
    assert_eq!(pairs.caption(1).unwrap(), "a boot, \"ankle\" kind");
    assert_eq!(pairs.text(1).unwrap().as_deref(), Some("a boot, \"ankle\" kind"), "the caption is the sample's text");
    let img = pairs.get(0).unwrap();
    assert_eq!((img.width, img.height, img.channels), (4, 3, 1));
    assert_eq!(img.pixels[5], 11, "pixel (1, 1) of the file");
    let e = pairs.get(2).unwrap_err().to_string();
    assert!(e.contains("index 2 is out of range for a dataset of 2 samples"), "{e}");
}

#[test]
fn a_bad_csv_is_an_error_naming_the_file_and_the_line() {
    let d = tempfile::tempdir().unwrap();
    png(&d.path().join("a.png"), 2, 2);
    let cases = [
        ("path,text\na.png,x\n", "the first line must be the header `image,caption`"),
        ("image,caption\na.png\n", "line 2: expected `image,caption`"),
        ("image,caption\nmissing.png,x\n", "line 2: image"),
        ("image,caption\n", "no pairs"),
    ];
    for (text, want) in cases {
        let csv = d.path().join("bad.csv");
        std::fs::write(&csv, text).unwrap();
        let e = CsvPairs::open(&csv).unwrap_err().to_string();
        assert!(e.contains("bad.csv") && e.contains(want), "{text:?}: {e}");
    }
}

fn labelled(n: usize, classes: usize) -> Arc<InMemory> {
    let images = (0..n).map(|i| Image::new(2, 2, 1, vec![i as u8; 4]).unwrap()).collect();
    Arc::new(InMemory::new(images, (0..n).map(|i| i % classes).collect(), classes).unwrap())
}

#[test]
fn class_captions_are_fixed_per_sample_and_seed_and_use_every_template_and_name() {
    let names = vec![vec!["cat".to_string(), "kitty".to_string()], vec!["dog".to_string(), "puppy".to_string()]];
    let templates = vec!["a {}".to_string(), "the {} here".to_string(), "{}!".to_string()];
    let a = ClassCaptions::new(labelled(200, 2), names.clone(), templates.clone(), 7, None).unwrap();
    let b = ClassCaptions::new(labelled(200, 2), names.clone(), templates.clone(), 7, Some(50)).unwrap();
    let c = ClassCaptions::new(labelled(200, 2), names.clone(), templates.clone(), 8, None).unwrap();
    assert_eq!(b.len(), 50);
    let caps: Vec<String> = (0..200).map(|i| a.caption(i).unwrap()).collect();
    assert_eq!((0..50).map(|i| b.caption(i).unwrap()).collect::<Vec<_>>(), caps[..50], "a limit changes no caption");
    assert_ne!((0..200).map(|i| c.caption(i).unwrap()).collect::<Vec<_>>(), caps, "another seed, other captions");
    for (i, cap) in caps.iter().enumerate() {
        let own = &names[i % 2];
        assert!(own.iter().any(|n| cap.contains(n.as_str())), "sample {i} (class {}): {cap}", i % 2);
    }
    assert_eq!(a.text(3).unwrap(), Some(caps[3].clone()), "the caption is the sample's text");
    for t in ["a cat", "a kitty", "the dog here", "puppy!"] {
        assert!(caps.iter().any(|c| c == t), "{t} never drawn");
    }
    let bad = ClassCaptions::new(labelled(4, 2), names.clone(), vec!["no slot".into()], 0, None);
    assert!(bad.err().unwrap().to_string().contains("exactly one {}"));
    let bad = ClassCaptions::new(labelled(4, 2), names[..1].to_vec(), templates, 0, None);
    assert!(bad.err().unwrap().to_string().contains("2 classes need a non-empty list of names each, got 1"));
}
