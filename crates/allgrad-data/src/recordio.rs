//! MXNet's indexed RecordIO, as insightface distributes face training sets (MS1MV2/MS1MV3,
//! Glint360K, WebFace42M): `train.rec` (the records), `train.idx` (one `key<TAB>offset` line per
//! record) and `property` (`classes,height,width`).
//!
//! A record on disk is a 4-byte magic number `0xced7230a`, a 4-byte word whose top 3 bits are
//! a continuation flag and whose low 29 bits are the length, the data, and zero padding to a
//! multiple of 4 bytes (little-endian, as MXNet writes on every machine it runs on). A record
//! whose data holds the magic number at a 4-byte aligned position is written in parts (flag 1
//! first, 2 middle, 3 last; the magic number between two parts is dropped on writing and put
//! back on reading). The data of an image record is an `IRHeader` (`flag: u32, label: f32,
//! id: u64, id2: u64`), then `flag` f32 labels when `flag > 0`, then the encoded image (JPEG or
//! PNG). The class of a sample is the scalar label, or the first of the label vector when
//! `flag > 0`, as insightface's `MXFaceDataset` takes it; it must be a whole number below the
//! class count of `property` (or, without that file, below the largest label plus one).
//!
//! Which records are samples follows insightface too: when the record of key 0 has `flag > 0`
//! it is a header record, and the samples are keys `1..label[0]`; otherwise every key of
//! `train.idx`, in the file's order.
//!
//! The index is read and every sample's header checked when the data set is opened (one
//! small read per record): an offset past the end of `train.rec`, a bad magic number, a length
//! running past the end, or a label that is not a class id is an error naming the file, the
//! offset and the value, or (with [`OnBadRecord::Skip`]) leaves that record out with a
//! warning. Records are read with positioned reads, so the loader's workers read in parallel;
//! sharding over ranks, shuffling and resuming are the [`crate::DistributedSampler`]'s, which
//! works on the sample indices.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::dataset::Dataset;
use crate::decode::{decode_image, ColorMode};
use crate::error::{DataError, DataResult};
use crate::image::Image;

/// The magic number that starts every record (and every part of a split record).
pub const RECORD_MAGIC: u32 = 0xced7_230a;
/// Bytes of an `IRHeader` (struct format `IfQQ`).
pub const IR_HEADER_LEN: usize = 24;
const LEN_MASK: u32 = (1 << 29) - 1;

/// What to do with a record that cannot be used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnBadRecord {
    /// Stop with an error naming the file, the offset and what is wrong.
    #[default]
    Error,
    /// Leave the record out, with a warning in the log naming it.
    Skip,
}

/// Options of [`RecordIo::open`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RecordIoOptions {
    /// Channel conversion of every image.
    pub color: ColorMode,
    /// A bad record: an error, or left out. With `skip`, opening also decodes every image
    /// once, so that one that does not decode is left out too (one full decode per record);
    /// with `error`, an image that does not decode is an error when it is read.
    pub on_corrupt: OnBadRecord,
}

/// The header of an image record, `IRHeader` with its label vector.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordHeader {
    /// 0 for a scalar label, else the length of the label vector.
    pub flag: u32,
    /// The scalar label (0 when `flag > 0`, as MXNet's `pack` writes it).
    pub label: f32,
    /// The label vector (`flag` values; empty for a scalar label).
    pub labels: Vec<f32>,
    /// The record's id.
    pub id: u64,
    /// The second id.
    pub id2: u64,
}

impl RecordHeader {
    /// A scalar label.
    pub fn scalar(label: f32, id: u64) -> Self {
        RecordHeader { flag: 0, label, labels: Vec::new(), id, id2: 0 }
    }

    /// The class label as insightface takes it: the scalar, or the first of the vector.
    pub fn class(&self) -> f32 {
        if self.flag > 0 {
            self.labels.first().copied().unwrap_or(f32::NAN)
        } else {
            self.label
        }
    }

    /// The header followed by `payload`, as MXNet's `recordio.pack` lays them out.
    pub fn pack(&self, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::with_capacity(IR_HEADER_LEN + 4 * self.labels.len() + payload.len());
        v.extend_from_slice(&(self.labels.len() as u32).to_le_bytes());
        v.extend_from_slice(&(if self.labels.is_empty() { self.label } else { 0.0 }).to_le_bytes());
        v.extend_from_slice(&self.id.to_le_bytes());
        v.extend_from_slice(&self.id2.to_le_bytes());
        for l in &self.labels {
            v.extend_from_slice(&l.to_le_bytes());
        }
        v.extend_from_slice(payload);
        v
    }

    /// Splits a record's data into its header and payload; `None` when it is too short.
    pub fn unpack(data: &[u8]) -> Option<(RecordHeader, &[u8])> {
        let head = data.get(..IR_HEADER_LEN)?;
        let u32_at = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(head[i..i + 8].try_into().expect("8 bytes"));
        let flag = u32_at(0);
        let label = f32::from_bits(u32_at(4));
        let rest = &data[IR_HEADER_LEN..];
        let n = flag as usize;
        let vec_bytes = n.checked_mul(4).filter(|b| *b <= rest.len())?;
        let labels = rest[..vec_bytes].chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))).collect();
        Some((RecordHeader { flag, label, labels, id: u64_at(8), id2: u64_at(16) }, &rest[vec_bytes..]))
    }
}

/// One sample: where its record starts, and its class.
#[derive(Clone, Copy, Debug)]
struct Item {
    offset: u64,
    label: u32,
}

/// A RecordIO face data set (see the module docs), decoded when read.
#[derive(Debug)]
pub struct RecordIo {
    rec: PathBuf,
    file: File,
    len: u64,
    items: Vec<Item>,
    num_classes: usize,
    color: ColorMode,
}

impl RecordIo {
    /// Opens `dir/train.rec`, `dir/train.idx` and (when present) `dir/property`.
    pub fn open(dir: impl AsRef<Path>, options: &RecordIoOptions) -> DataResult<Self> {
        let dir = dir.as_ref();
        let property = dir.join("property");
        let property = property.exists().then_some(property);
        Self::open_files(dir.join("train.rec"), dir.join("train.idx"), property.as_deref(), options)
    }

    /// Opens a `.rec` file with its `.idx` and, optionally, its `property` file (without it
    /// the class count is the largest label plus one).
    pub fn open_files(
        rec: impl AsRef<Path>,
        idx: impl AsRef<Path>,
        property: Option<&Path>,
        options: &RecordIoOptions,
    ) -> DataResult<Self> {
        let (rec, idx) = (rec.as_ref().to_path_buf(), idx.as_ref());
        let file = File::open(&rec).map_err(|e| DataError::io(&rec, e))?;
        let len = file.metadata().map_err(|e| DataError::io(&rec, e))?.len();
        let keys = read_index(idx)?;
        let declared = property.map(read_property).transpose()?;
        let mut this = RecordIo { rec, file, len, items: Vec::new(), num_classes: declared.unwrap_or(0), color: options.color };
        // insightface's header record: key 0 with a label vector [first identity record, ...].
        let samples: Vec<(u64, u64)> = match keys.iter().find(|(k, _)| *k == 0) {
            Some(&(_, off)) => {
                let (header, _) = this.header_at(off)?;
                if header.flag > 0 {
                    let end = header.labels[0];
                    if !(end.is_finite() && end >= 1.0) {
                        return Err(this.bad(off, format!("header record (key 0) gives {end} as the end of the samples")));
                    }
                    let end = end as u64;
                    let by_key: std::collections::HashMap<u64, u64> = keys.iter().copied().collect();
                    let mut v = Vec::with_capacity(end as usize);
                    for k in 1..end {
                        let off = by_key.get(&k).copied().ok_or_else(|| DataError::RecordIndex {
                            path: idx.to_path_buf(),
                            line: 0,
                            reason: format!("the header record names keys 1..{end}, but key {k} is not in the index"),
                        })?;
                        v.push((k, off));
                    }
                    v
                } else {
                    keys
                }
            }
            None => keys,
        };
        let mut items = Vec::with_capacity(samples.len());
        let mut max_label = 0usize;
        for (_, off) in samples {
            let checked = this.header_at(off).and_then(|(h, _)| this.class_of(off, &h, declared));
            let checked = match checked {
                Ok(label) if options.on_corrupt == OnBadRecord::Skip => this.image_at(off).map(|_| label),
                other => other,
            };
            match checked {
                Ok(label) => {
                    max_label = max_label.max(label as usize);
                    items.push(Item { offset: off, label });
                }
                Err(e) if options.on_corrupt == OnBadRecord::Skip => {
                    tracing::warn!(error = %e, "skipping a bad record");
                }
                Err(e) => return Err(e),
            }
        }
        if items.is_empty() {
            return Err(DataError::Empty { path: this.rec.clone() });
        }
        this.items = items;
        if declared.is_none() {
            this.num_classes = max_label + 1;
        }
        Ok(this)
    }

    /// The `.rec` file.
    pub fn path(&self) -> &Path {
        &self.rec
    }

    /// Byte offset of sample `index`'s record in the `.rec` file.
    pub fn offset(&self, index: usize) -> Option<u64> {
        self.items.get(index).map(|i| i.offset)
    }

    fn bad(&self, offset: u64, reason: String) -> DataError {
        DataError::Record { path: self.rec.clone(), offset, reason }
    }

    /// The record's data at `offset`, its parts joined.
    fn record_at(&self, offset: u64) -> DataResult<Vec<u8>> {
        let mut out = Vec::new();
        let mut pos = offset;
        loop {
            let mut head = [0u8; 8];
            self.read_exact_at(&mut head, pos, offset)?;
            let magic = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
            if magic != RECORD_MAGIC {
                let what = if pos == offset { "record" } else { "part of the record" };
                return Err(self
                    .bad(pos, format!("{what} starts with 0x{magic:08x}, not the RecordIO magic number 0x{RECORD_MAGIC:08x}")));
            }
            let word = u32::from_le_bytes(head[4..].try_into().expect("4 bytes"));
            let (cflag, n) = (word >> 29, (word & LEN_MASK) as u64);
            let first = pos == offset;
            if (first && !matches!(cflag, 0 | 1)) || (!first && !matches!(cflag, 2 | 3)) {
                return Err(self.bad(
                    pos,
                    format!("continuation flag {cflag} where the record {}", if first { "starts" } else { "goes on" }),
                ));
            }
            if pos + 8 + n > self.len {
                return Err(self.bad(
                    pos,
                    format!("length {n} runs past the end of the file ({} bytes): the .idx offset does not match the .rec, or it is cut short", self.len),
                ));
            }
            let start = out.len();
            out.resize(start + n as usize, 0);
            self.read_exact_at(&mut out[start..], pos + 8, offset)?;
            pos += 8 + n.div_ceil(4) * 4;
            if cflag == 0 || cflag == 3 {
                return Ok(out);
            }
            out.extend_from_slice(&RECORD_MAGIC.to_le_bytes());
        }
    }

    fn read_exact_at(&self, buf: &mut [u8], pos: u64, record: u64) -> DataResult<()> {
        if pos + buf.len() as u64 > self.len {
            return Err(self.bad(
                record,
                format!("offset {pos} is past the end of the file ({} bytes): the .idx does not match the .rec", self.len),
            ));
        }
        self.file.read_exact_at(buf, pos).map_err(|e| DataError::io(&self.rec, e))
    }

    /// The header of the record at `offset`, and the record's data.
    fn header_at(&self, offset: u64) -> DataResult<(RecordHeader, Vec<u8>)> {
        let data = self.record_at(offset)?;
        let (h, _) = RecordHeader::unpack(&data)
            .ok_or_else(|| self.bad(offset, format!("{} bytes is too short for an IRHeader and its labels", data.len())))?;
        Ok((h, data))
    }

    fn class_of(&self, offset: u64, h: &RecordHeader, classes: Option<usize>) -> DataResult<u32> {
        let value = h.class();
        let whole = value.is_finite() && value >= 0.0 && value.fract() == 0.0 && value < u32::MAX as f32;
        if !whole {
            return Err(self.bad(offset, format!("label {value} is not a class id (a whole number from 0)")));
        }
        if let Some(c) = classes {
            if value as usize >= c {
                return Err(self.bad(offset, format!("label {value} is outside the {c} classes of the property file")));
            }
        }
        Ok(value as u32)
    }

    fn image_at(&self, offset: u64) -> DataResult<Image> {
        let (_, data) = self.header_at(offset)?;
        let (_, payload) = RecordHeader::unpack(&data).expect("checked by header_at");
        let name = PathBuf::from(format!("{}:offset {offset}", self.rec.display()));
        decode_image(payload, self.color, &name)
    }

    fn item(&self, index: usize) -> DataResult<&Item> {
        self.items.get(index).ok_or(DataError::IndexOutOfRange { index, len: self.items.len() })
    }
}

impl Dataset for RecordIo {
    fn len(&self) -> usize {
        self.items.len()
    }

    fn get(&self, index: usize) -> DataResult<Image> {
        self.image_at(self.item(index)?.offset)
    }

    fn label(&self, index: usize) -> DataResult<usize> {
        Ok(self.item(index)?.label as usize)
    }

    fn num_classes(&self) -> usize {
        self.num_classes
    }
}

/// The `key<TAB>offset` lines of an `.idx` file, in the file's order.
fn read_index(path: &Path) -> DataResult<Vec<(u64, u64)>> {
    let text = std::fs::read_to_string(path).map_err(|e| DataError::io(path, e))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| DataError::RecordIndex { path: path.into(), line: n + 1, reason };
        let mut parts = line.split('\t');
        let (Some(k), Some(o), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad(format!("`{line}` is not `key<TAB>offset`")));
        };
        let k: u64 = k.trim().parse().map_err(|_| bad(format!("key `{k}` is not a whole number")))?;
        let o: u64 = o.trim().parse().map_err(|_| bad(format!("offset `{o}` is not a whole number")))?;
        out.push((k, o));
    }
    if out.is_empty() {
        return Err(DataError::Empty { path: path.into() });
    }
    Ok(out)
}

/// The class count from a `property` file (`classes,height,width`).
fn read_property(path: &Path) -> DataResult<usize> {
    let text = std::fs::read_to_string(path).map_err(|e| DataError::io(path, e))?;
    let first = text.trim().split(',').next().unwrap_or_default().trim();
    match first.parse::<usize>() {
        Ok(c) if c > 0 => Ok(c),
        _ => Err(DataError::RecordIndex {
            path: path.into(),
            line: 1,
            reason: format!("`{}` does not start with a positive class count (`classes,height,width`)", text.trim()),
        }),
    }
}

/// Writes an indexed RecordIO pair as MXNet's `MXIndexedRecordIO` does (records split where
/// their data holds the magic number, padded to 4 bytes, one `key<TAB>offset` line each).
pub struct RecordIoWriter {
    rec: std::io::BufWriter<File>,
    idx: std::io::BufWriter<File>,
    rec_path: PathBuf,
    idx_path: PathBuf,
    pos: u64,
}

impl RecordIoWriter {
    /// Creates (or truncates) `rec` and `idx`.
    pub fn create(rec: impl AsRef<Path>, idx: impl AsRef<Path>) -> DataResult<Self> {
        let (rec_path, idx_path) = (rec.as_ref().to_path_buf(), idx.as_ref().to_path_buf());
        let open = |p: &Path| File::create(p).map(std::io::BufWriter::new).map_err(|e| DataError::io(p, e));
        Ok(RecordIoWriter { rec: open(&rec_path)?, idx: open(&idx_path)?, rec_path, idx_path, pos: 0 })
    }

    /// Appends one record of `data` under `key`; returns its offset.
    pub fn write(&mut self, key: u64, data: &[u8]) -> DataResult<u64> {
        if data.len() as u64 > LEN_MASK as u64 {
            return Err(DataError::Record {
                path: self.rec_path.clone(),
                offset: self.pos,
                reason: format!("{} bytes is more than a record holds (2^29 - 1)", data.len()),
            });
        }
        let offset = self.pos;
        let magic = RECORD_MAGIC.to_le_bytes();
        let mut out = Vec::with_capacity(data.len() + 16);
        let mut start = 0usize;
        let aligned = data.len() / 4 * 4;
        for i in (0..aligned).step_by(4) {
            if data[i..i + 4] == magic {
                let flag = if start == 0 { 1u32 } else { 2 };
                out.extend_from_slice(&magic);
                out.extend_from_slice(&((flag << 29) | (i - start) as u32).to_le_bytes());
                out.extend_from_slice(&data[start..i]);
                start = i + 4;
            }
        }
        let flag = if start == 0 { 0u32 } else { 3 };
        out.extend_from_slice(&magic);
        out.extend_from_slice(&((flag << 29) | (data.len() - start) as u32).to_le_bytes());
        out.extend_from_slice(&data[start..]);
        out.resize(out.len() + (4 - data.len() % 4) % 4, 0);
        self.rec.write_all(&out).map_err(|e| DataError::io(&self.rec_path, e))?;
        writeln!(self.idx, "{key}\t{offset}").map_err(|e| DataError::io(&self.idx_path, e))?;
        self.pos += out.len() as u64;
        Ok(offset)
    }

    /// Flushes both files.
    pub fn finish(mut self) -> DataResult<()> {
        self.rec.flush().map_err(|e| DataError::io(&self.rec_path, e))?;
        self.idx.flush().map_err(|e| DataError::io(&self.idx_path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32, seed: u8) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8 * 20 + seed, y as u8 * 30, seed]));
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageOutputFormat::Png).unwrap();
        out.into_inner()
    }

    /// Three records (labels 2, vector [1, 7.5], 0) in `dir`, with a `property` of 3 classes.
    fn sample(dir: &Path) -> Vec<u64> {
        let mut w = RecordIoWriter::create(dir.join("train.rec"), dir.join("train.idx")).unwrap();
        let mut offs = Vec::new();
        offs.push(w.write(0, &RecordHeader::scalar(2.0, 0).pack(&png(3, 2, 1))).unwrap());
        let h = RecordHeader { flag: 2, label: 0.0, labels: vec![1.0, 7.5], id: 1, id2: 0 };
        offs.push(w.write(1, &h.pack(&png(3, 2, 2))).unwrap());
        offs.push(w.write(2, &RecordHeader::scalar(0.0, 2).pack(&png(3, 2, 3))).unwrap());
        w.finish().unwrap();
        std::fs::write(dir.join("property"), "3,2,3\n").unwrap();
        offs
    }

    #[test]
    fn records_read_back_with_labels_and_pixels() {
        let dir = tempfile::tempdir().unwrap();
        sample(dir.path());
        let ds = RecordIo::open(dir.path(), &RecordIoOptions::default()).unwrap();
        assert_eq!((ds.len(), ds.num_classes()), (3, 3));
        assert_eq!((0..3).map(|i| ds.label(i).unwrap()).collect::<Vec<_>>(), [2, 1, 0]);
        let img = ds.get(1).unwrap();
        assert_eq!((img.width, img.height, img.channels), (3, 2, 3));
        assert_eq!([img.at(2, 1, 0), img.at(2, 1, 1), img.at(2, 1, 2)], [42, 30, 2]);
    }

    #[test]
    fn data_holding_the_magic_number_is_split_and_joined_back() {
        let dir = tempfile::tempdir().unwrap();
        let magic = RECORD_MAGIC.to_le_bytes();
        // The magic at aligned positions 0, 8 and 12 (twice in a row), then at the end;
        // unaligned at 21; a length that is not a multiple of 4.
        let mut data = magic.to_vec();
        data.extend_from_slice(&[1, 2, 3, 4]);
        data.extend_from_slice(&magic);
        data.extend_from_slice(&magic);
        data.extend_from_slice(&[9, 9, 9, 9, 9]);
        data.extend_from_slice(&magic);
        data.extend_from_slice(&[5, 6, 7]);
        data.extend_from_slice(&magic);
        let mut w = RecordIoWriter::create(dir.path().join("a.rec"), dir.path().join("a.idx")).unwrap();
        let (o1, o2) = (w.write(0, &data).unwrap(), w.write(1, &[7; 5]).unwrap());
        w.finish().unwrap();
        let bytes = std::fs::read(dir.path().join("a.rec")).unwrap();
        assert_eq!(bytes.len() % 4, 0);
        let f = File::open(dir.path().join("a.rec")).unwrap();
        let ds = RecordIo {
            rec: "a.rec".into(),
            file: f,
            len: bytes.len() as u64,
            items: vec![],
            num_classes: 0,
            color: ColorMode::Rgb,
        };
        assert_eq!(ds.record_at(o1).unwrap(), data);
        assert_eq!(ds.record_at(o2).unwrap(), [7; 5]);
    }

    #[test]
    fn bad_records_name_the_file_the_offset_and_the_value() {
        let dir = tempfile::tempdir().unwrap();
        let offs = sample(dir.path());
        let rec = dir.path().join("train.rec");
        let full = std::fs::read(&rec).unwrap();
        // A label outside the class count of `property`.
        std::fs::write(dir.path().join("property"), "2,2,3\n").unwrap();
        let err = RecordIo::open(dir.path(), &RecordIoOptions::default()).unwrap_err().to_string();
        assert!(err.contains("train.rec") && err.contains(&format!("offset {}", offs[0])) && err.contains("label 2"), "{err}");
        let skip = RecordIoOptions { on_corrupt: OnBadRecord::Skip, ..Default::default() };
        let ds = RecordIo::open(dir.path(), &skip).unwrap();
        assert_eq!((ds.len(), ds.offset(0), ds.label(1).unwrap()), (2, Some(offs[1]), 0));
        std::fs::write(dir.path().join("property"), "3,2,3\n").unwrap();
        // A bad magic number.
        let mut bad = full.clone();
        bad[offs[1] as usize] ^= 0xff;
        std::fs::write(&rec, &bad).unwrap();
        let err = RecordIo::open(dir.path(), &RecordIoOptions::default()).unwrap_err().to_string();
        assert!(err.contains(&format!("offset {}", offs[1])) && err.contains("0xced723f5"), "{err}");
        assert_eq!(RecordIo::open(dir.path(), &skip).unwrap().len(), 2);
        std::fs::write(&rec, &full).unwrap();
        // .idx offsets that do not match the .rec: shifted, and past its end.
        let idx = dir.path().join("train.idx");
        std::fs::write(&idx, format!("0\t{}\n1\t{}\n2\t{}\n", offs[0], offs[1] + 4, offs[2])).unwrap();
        let err = RecordIo::open(dir.path(), &RecordIoOptions::default()).unwrap_err().to_string();
        assert!(err.contains("train.rec") && err.contains(&format!("offset {}", offs[1] + 4)), "{err}");
        std::fs::write(&idx, format!("0\t{}\n1\t{}\n", offs[0], full.len() + 100)).unwrap();
        let err = RecordIo::open(dir.path(), &RecordIoOptions::default()).unwrap_err().to_string();
        assert!(err.contains(&format!("offset {}", full.len() + 100)) && err.contains("does not match"), "{err}");
        std::fs::write(&idx, "0\tnot-a-number\n").unwrap();
        let err = RecordIo::open(dir.path(), &RecordIoOptions::default()).unwrap_err().to_string();
        assert!(err.contains("train.idx") && err.contains("line 1"), "{err}");
        // A record cut short: every prefix of the file is an error, never a panic.
        std::fs::write(&idx, format!("0\t{}\n1\t{}\n2\t{}\n", offs[0], offs[1], offs[2])).unwrap();
        for n in (0..full.len()).step_by(7) {
            std::fs::write(&rec, &full[..n]).unwrap();
            let r = RecordIo::open(dir.path(), &RecordIoOptions::default());
            assert!(r.is_err() || (0..3).any(|i| r.as_ref().unwrap().get(i).is_err()), "prefix {n}");
        }
    }
}
