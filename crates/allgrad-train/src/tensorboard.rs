//! TensorBoard's event file: `events.out.tfevents.<secs>.<host>` beside `metrics.jsonl`, the
//! same scalars at the same steps, for `tensorboard --logdir runs/` (`log.tensorboard`).
//!
//! The file is a TFRecord stream: each record is its length (u64, little-endian), the masked
//! CRC32C of those 8 bytes, the data, and the masked CRC32C of the data; the data is a protobuf
//! `Event`. The first event carries only `file_version = "brain.Event:2"`; each later one a
//! step's scalars in a `Summary`. Every record is flushed as it is written, so a run that
//! crashes keeps what it logged.
//!
//! The protobuf is encoded by hand: three small messages of a fixed, published layout
//! (`tensorflow/core/util/event.proto` and `summary.proto`), a few fields each, need no
//! protobuf crate or code generator.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The events file of a run (rank 0 only).
pub struct EventsWriter {
    path: PathBuf,
    file: File,
}

impl EventsWriter {
    /// Creates `dir/events.out.tfevents.<secs>.<host>` and writes its version record. On a
    /// resume from `resume_step`, a restart marker (`SessionLog` START at the next step)
    /// follows, by which TensorBoard's reader drops what an earlier file logged past the
    /// checkpoint, as `metrics.jsonl` drops those lines.
    ///
    /// The error is the file's path with the operating system's error.
    pub fn create(dir: &Path, resume_step: Option<usize>) -> Result<EventsWriter, (PathBuf, std::io::Error)> {
        let now = wall_time();
        let path = dir.join(format!("events.out.tfevents.{}.{}", now as u64, host()));
        let file = match OpenOptions::new().create(true).append(true).open(&path) {
            Ok(f) => f,
            Err(e) => return Err((path, e)),
        };
        let mut w = EventsWriter { path, file };
        let first = w.write_record(&event(now, 0, Body::FileVersion("brain.Event:2")));
        let restart = match resume_step {
            Some(s) => w.write_record(&event(now, s as i64 + 1, Body::SessionStart)),
            None => Ok(()),
        };
        match first.and(restart) {
            Ok(()) => Ok(w),
            Err(e) => Err((w.path, e)),
        }
    }

    /// Writes `scalars` (tag, value; as f32, TensorBoard's `simple_value`) at `step`, one
    /// event, and flushes it. Nothing is written for an empty list.
    pub fn scalars(&mut self, step: usize, scalars: &[(String, f64)]) -> std::io::Result<()> {
        if scalars.is_empty() {
            return Ok(());
        }
        self.write_record(&event(wall_time(), step as i64, Body::Scalars(scalars)))
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_record(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.file.write_all(&frame(data))?;
        self.file.flush()
    }
}

/// CRC32C as TFRecord stores it: rotated right by 15 bits plus a constant, so that a CRC of
/// data that itself holds CRCs is not degenerate.
pub fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord: length, its masked CRC, the data, the data's masked CRC.
pub fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// What an event carries besides its time and step.
enum Body<'a> {
    /// `file_version` (field 3).
    FileVersion(&'a str),
    /// `summary` (field 5): one `Value { tag = 1, simple_value = 2 }` per scalar.
    Scalars(&'a [(String, f64)]),
    /// `session_log` (field 7; 6 is the deprecated `log_message`): `SessionLog { status = 1:
    /// START }`.
    SessionStart,
}

/// `Event { wall_time = 1 (double), step = 2 (int64), ... }`, protobuf-encoded.
fn event(wall_time: f64, step: i64, body: Body) -> Vec<u8> {
    let mut out = Vec::new();
    out.push(1 << 3 | 1); // wall_time, 64-bit
    out.extend_from_slice(&wall_time.to_le_bytes());
    out.push(2 << 3); // step, varint
    varint(&mut out, step as u64);
    match body {
        Body::FileVersion(v) => bytes_field(&mut out, 3, v.as_bytes()),
        Body::Scalars(scalars) => {
            let mut summary = Vec::new();
            for (tag, value) in scalars {
                let mut v = Vec::new();
                bytes_field(&mut v, 1, tag.as_bytes());
                v.push(2 << 3 | 5); // simple_value, 32-bit
                v.extend_from_slice(&(*value as f32).to_le_bytes());
                bytes_field(&mut summary, 1, &v);
            }
            bytes_field(&mut out, 5, &summary);
        }
        Body::SessionStart => bytes_field(&mut out, 7, &[1 << 3, 1]),
    }
    out
}

/// A length-delimited field (wire type 2).
fn bytes_field(out: &mut Vec<u8>, field: u8, data: &[u8]) {
    out.push(field << 3 | 2);
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

fn varint(out: &mut Vec<u8>, mut x: u64) {
    while x >= 0x80 {
        out.push((x as u8) | 0x80);
        x >>= 7;
    }
    out.push(x as u8);
}

fn wall_time() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// The host name for the file name (as TensorFlow's writers name theirs), `localhost` when
/// it cannot be read; characters other than letters, digits, `-` and `.` become `_`.
fn host() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name: String =
        name.trim().chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' }).collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The masked CRC and a whole record against values computed independently: a bit-by-bit
    /// CRC32C (reflected polynomial 0x82F63B78) and TFRecord's mask, in Python, with no CRC
    /// library:
    ///
    /// ```text
    /// def crc32c(b):
    ///     c = 0xFFFFFFFF
    ///     for x in b:
    ///         c ^= x
    ///         for _ in range(8): c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
    ///     return c ^ 0xFFFFFFFF
    /// mask = lambda c: ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF
    /// ```
    #[test]
    fn records_are_framed_with_tfrecords_masked_crc32c() {
        // CRC32C's check value: crc32c(b"123456789") = 0xE3069283.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(masked_crc(b"123456789"), MASKED_CHECK);
        // The version record, wall time 0, step 0: every byte.
        let data = event(0.0, 0, Body::FileVersion("brain.Event:2"));
        assert_eq!(data, VERSION_EVENT);
        assert_eq!(frame(&data), VERSION_RECORD);
    }

    const MASKED_CHECK: u32 = 0xC78A_B0E5;
    const VERSION_EVENT: &[u8] = &[
        0x09, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x1a, 0x0d, 0x62, 0x72, 0x61, 0x69, 0x6e, 0x2e, 0x45,
        0x76, 0x65, 0x6e, 0x74, 0x3a, 0x32,
    ];
    const VERSION_RECORD: &[u8] = &[
        0x1a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x12, 0x9b, 0xd8, 0x2d, 0x09, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x10, 0x00, 0x1a, 0x0d, 0x62, 0x72, 0x61, 0x69, 0x6e, 0x2e, 0x45, 0x76, 0x65, 0x6e, 0x74, 0x3a, 0x32, 0x31, 0xe6,
        0xc7, 0x8b,
    ];

    #[test]
    fn scalars_encode_as_summary_values() {
        let data = event(1.5, 300, Body::Scalars(&[("loss".into(), 0.25)]));
        let mut want = vec![0x09];
        want.extend_from_slice(&1.5f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 0xac, 0x02]); // 300 as a varint
                                                     // summary (5) { value (1) { tag (1) "loss", simple_value (2) 0.25f32 } }
        want.extend_from_slice(&[0x2a, 13, 0x0a, 11, 0x0a, 4, b'l', b'o', b's', b's', 0x15]);
        want.extend_from_slice(&0.25f32.to_le_bytes());
        assert_eq!(data, want);
    }

    #[test]
    fn an_events_file_that_cannot_be_created_names_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no/such/dir");
        let Err((path, _)) = EventsWriter::create(&missing, None) else { panic!("created in a missing directory") };
        assert!(path.starts_with(&missing) && path.file_name().unwrap().to_str().unwrap().starts_with("events.out.tfevents."));
        let mut w = EventsWriter::create(dir.path(), Some(4)).unwrap();
        w.scalars(5, &[("loss".into(), 1.0)]).unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        // Three records: the version, the restart marker, the scalars; each framed.
        let mut at = 0;
        let mut n = 0;
        while at < bytes.len() {
            let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            let data = &bytes[at + 12..at + 12 + len];
            assert_eq!(u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()), masked_crc(&bytes[at..at + 8]));
            assert_eq!(u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap()), masked_crc(data));
            at += 16 + len;
            n += 1;
        }
        assert_eq!(n, 3);
    }
}
