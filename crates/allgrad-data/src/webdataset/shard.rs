//! Reading one tar shard as webdataset samples: consecutive members that share a key (the
//! member's path up to the first dot of its file name) are one sample, each member under its
//! extension (the rest of the name, lower-cased): `n01440764_10026.jpg` and
//! `n01440764_10026.cls` are sample `n01440764_10026` with members `jpg` and `cls`.
//!
//! Everything that is wrong with a shard is an error naming the shard and the byte offset: a
//! file that does not exist, a header that is not a tar header, a member whose data runs past
//! the end of the file, an archive without its end-of-archive blocks (a file cut exactly
//! between two members), a key that appears twice in a row with the same extension.
//!
//! A shard whose name ends in `.gz` or `.tgz` (`train-000000.tar.gz`) is read through gzip:
//! forward only, so reading it from a byte offset (random access, a resume) decompresses the
//! shard up to there; corrupt compressed data is an error naming the shard like any other.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};

use flate2::read::MultiGzDecoder;
use std::path::{Path, PathBuf};

use crate::error::{DataError, DataResult};

/// One sample of a shard: its key, where it starts, and its members by extension.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    /// The key shared by the members (path up to the first dot of the file name).
    pub key: String,
    /// Byte offset of the first member's first header in the shard (its PAX or GNU
    /// long-name header when it has one): where [`ShardReader::open_at`] reads it again.
    pub offset: u64,
    /// `(extension, bytes)` of each member, in archive order; extensions lower-case.
    pub members: Vec<(String, Vec<u8>)>,
}

/// The extensions of the members read as a sample's image, in order of preference.
const IMAGE_MEMBERS: [&str; 4] = ["jpg", "jpeg", "png", "webp"];

impl Sample {
    /// The bytes of the member with extension `ext`, if any.
    pub fn member(&self, ext: &str) -> Option<&[u8]> {
        self.members.iter().find(|(e, _)| e == ext).map(|(_, b)| b.as_slice())
    }

    /// The image member: the first of `jpg`, `jpeg`, `png`, `webp` present (its extension,
    /// bytes).
    pub fn image(&self) -> Option<(&str, &[u8])> {
        IMAGE_MEMBERS.iter().find_map(|e| self.member(e).map(|b| (*e, b)))
    }

    /// The class id of the `cls` member (an integer in ASCII, surrounding white space
    /// allowed, as webdataset writes it): `None` without a `cls` member, `Some(Err(text))`
    /// when it is not a non-negative integer.
    pub fn class(&self) -> Option<Result<usize, String>> {
        let raw = self.member("cls")?;
        let text = String::from_utf8_lossy(raw);
        Some(text.trim().parse::<usize>().map_err(|_| text.trim().chars().take(40).collect()))
    }

    /// The `txt` member as text (image-caption pairs), if any.
    pub fn text(&self) -> Option<String> {
        self.member("txt").map(|b| String::from_utf8_lossy(b).into_owned())
    }

    /// The caption `field` names; `Err(why)` when the sample lacks it (the member, the JSON
    /// field, or valid JSON), naming what it has.
    pub fn caption(&self, field: &CaptionField) -> Result<String, String> {
        let members = || self.members.iter().map(|(e, _)| e.as_str()).collect::<Vec<_>>().join(", ");
        match field {
            CaptionField::Member(ext) => match self.member(ext) {
                Some(b) => Ok(String::from_utf8_lossy(b).into_owned()),
                None => Err(format!("no caption: no `{ext}` member (members: {})", members())),
            },
            CaptionField::Json(key) => {
                let raw = self.member("json").ok_or_else(|| format!("no caption: no `json` member (members: {})", members()))?;
                let value: serde_json::Value =
                    serde_json::from_slice(raw).map_err(|e| format!("no caption: the `json` member is not JSON ({e})"))?;
                match value.get(key) {
                    Some(serde_json::Value::String(s)) => Ok(s.clone()),
                    Some(other) => Err(format!("no caption: field `{key}` of the `json` member is not a string ({other})")),
                    None => Err(format!("no caption: the `json` member has no field `{key}`")),
                }
            }
        }
    }
}

/// Where a sample's caption is, for image-text pairs: a member read as UTF-8 text (`txt`, as
/// img2dataset writes captions), or a string field of the `json` member (`json:caption`). In a
/// config, that string.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum CaptionField {
    /// The member with this extension.
    Member(String),
    /// This field of the `json` member.
    Json(String),
}

impl Default for CaptionField {
    fn default() -> Self {
        CaptionField::Member("txt".into())
    }
}

impl TryFrom<String> for CaptionField {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        match s.split_once(':') {
            Some(("json", key)) if !key.is_empty() => Ok(CaptionField::Json(key.into())),
            None if !s.is_empty() && !s.contains('.') => Ok(CaptionField::Member(s.to_ascii_lowercase())),
            _ => Err(format!("caption `{s}`: give a member's extension (`txt`) or a field of the json member (`json:caption`)")),
        }
    }
}

impl From<CaptionField> for String {
    fn from(c: CaptionField) -> String {
        match c {
            CaptionField::Member(ext) => ext,
            CaptionField::Json(key) => format!("json:{key}"),
        }
    }
}

/// The webdataset key and extension of a member path: `dir/a.b.c` is key `dir/a`, extension
/// `b.c` (lower-cased). `None` for a name without a dot (webdataset skips those).
pub fn key_and_extension(path: &str) -> Option<(&str, String)> {
    let name_start = path.rfind('/').map_or(0, |i| i + 1);
    let dot = path[name_start..].find('.')? + name_start;
    if dot == name_start {
        return None; // a hidden file such as `.DS_Store`
    }
    Some((&path[..dot], path[dot + 1..].to_ascii_lowercase()))
}

/// A member as read: key, extension, offset of its first header, bytes.
type Member = (String, String, u64, Vec<u8>);

/// A shard's bytes: the file, or the file through gzip.
enum Source {
    Plain(BufReader<File>),
    Gz(BufReader<MultiGzDecoder<File>>),
}

impl Read for Source {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Source::Plain(r) => r.read(buf),
            Source::Gz(r) => r.read(buf),
        }
    }
}

/// Whether `path` names a gzip-compressed shard (`.gz`, `.tgz`).
fn gzipped(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gz") || e.eq_ignore_ascii_case("tgz"))
}

/// The samples of one shard, in order. Reading goes forward only (no seeking), so a shard
/// may be any file the OS reads sequentially.
pub struct ShardReader {
    path: PathBuf,
    reader: Source,
    /// The file's length (of a plain shard; unknown, `u64::MAX`, through gzip).
    len: u64,
    /// Offset of the next header.
    pos: u64,
    /// The first member of the next sample, already read.
    pending: Option<Member>,
    /// What went wrong reading on after the last sample given (where that read started, the
    /// error): the next call returns it, so that the sample before a fault is given whole.
    deferred: Option<(u64, DataError)>,
    done: bool,
}

const BLOCK: u64 = 512;

/// The largest member read from a gzip-compressed shard (1 GiB).
const MAX_GZ_MEMBER: u64 = 1 << 30;

impl ShardReader {
    /// Opens `path` to read it through (reads of 1 MiB); a missing or unreadable file is an
    /// error naming it.
    pub fn open(path: &Path) -> DataResult<Self> {
        Self::with_buffer(path, 1 << 20)
    }

    fn with_buffer(path: &Path, bytes: usize) -> DataResult<Self> {
        let file = File::open(path).map_err(|source| DataError::ShardMissing { shard: path.into(), source })?;
        let (reader, len) = if gzipped(path) {
            (Source::Gz(BufReader::with_capacity(bytes, MultiGzDecoder::new(file))), u64::MAX)
        } else {
            let len = file.metadata().map_err(|e| DataError::io(path, e))?.len();
            (Source::Plain(BufReader::with_capacity(bytes, file)), len)
        };
        Ok(ShardReader { path: path.into(), reader, len, pos: 0, pending: None, deferred: None, done: false })
    }

    /// Opens `path` at byte `offset`, the first header of a sample's first member (a
    /// position a [`Sample`] gave), to read a sample or a few (reads of 64 KiB).
    pub fn open_at(path: &Path, offset: u64) -> DataResult<Self> {
        let mut r = Self::with_buffer(path, 1 << 16)?;
        r.seek_to(offset)?;
        Ok(r)
    }

    /// Opens `path` to read it through from byte `offset` (a [`ShardReader::resume_point`]),
    /// or, when `done`, as read to its end.
    pub(crate) fn resume(path: &Path, offset: u64, done: bool) -> DataResult<Self> {
        let mut r = Self::open(path)?;
        r.seek_to(offset)?;
        r.done = done;
        Ok(r)
    }

    /// Where the next sample starts (its first header), and whether the shard has been read
    /// to its end: what [`ShardReader::resume`] takes to read on from here.
    pub(crate) fn resume_point(&self) -> (u64, bool) {
        match &self.deferred {
            Some((at, _)) => (*at, false),
            None => (self.pending.as_ref().map_or(self.pos, |m| m.2), self.done),
        }
    }

    /// Moves a reader at byte 0 to byte `offset` (through gzip: reads up to there).
    fn seek_to(&mut self, offset: u64) -> DataResult<()> {
        match &mut self.reader {
            Source::Plain(r) => {
                r.seek(SeekFrom::Start(offset)).map_err(|e| DataError::io(&self.path, e))?;
            }
            Source::Gz(_) => self.skip(offset)?,
        }
        self.pos = offset;
        Ok(())
    }

    /// The shard's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn corrupt(&self, offset: u64, reason: impl Into<String>) -> DataError {
        DataError::Shard { shard: self.path.clone(), offset, reason: reason.into() }
    }

    /// Reads exactly `buf.len()` bytes at the current position; `Ok(false)` at a clean end of
    /// the file (no byte left).
    fn read_block(&mut self, buf: &mut [u8], what: &str) -> DataResult<bool> {
        let mut n = 0;
        while n < buf.len() {
            match self.reader.read(&mut buf[n..]) {
                Ok(0) if n == 0 => return Ok(false),
                Ok(0) => {
                    return Err(self.corrupt(self.pos, format!("{what}: the file ends after {n} of its {} bytes", buf.len())))
                }
                Ok(k) => n += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if matches!(self.reader, Source::Gz(_)) => {
                    return Err(self.corrupt(self.pos, format!("{what}: the gzip stream does not decode ({e})")))
                }
                Err(e) => return Err(DataError::io(&self.path, e)),
            }
        }
        Ok(true)
    }

    /// The next member: `(key, extension, header offset, bytes)`, or `None` at the end of the
    /// archive. Members without an extension and entries that are not regular files
    /// (folders) are passed over, as webdataset does; PAX and GNU long-name headers are
    /// understood.
    fn next_member(&mut self) -> DataResult<Option<Member>> {
        let mut long_name: Option<String> = None;
        // Where the member starts: its first PAX or GNU long-name header, if it has one.
        let mut start: Option<u64> = None;
        loop {
            let at = self.pos;
            let mut header = [0u8; BLOCK as usize];
            if !self.read_block(&mut header, "a member header")? {
                return Err(self.corrupt(at, "the file ends without the tar end-of-archive blocks (cut short after a member)"));
            }
            self.pos += BLOCK;
            if header.iter().all(|&b| b == 0) {
                return Ok(None);
            }
            let h = tar::Header::from_byte_slice(&header);
            let stored = h.cksum().map_err(|e| self.corrupt(at, format!("not a tar header ({e})")))?;
            let sum: u32 = header[..148].iter().chain(&header[156..]).map(|&b| b as u32).sum::<u32>() + 8 * 32;
            if sum != stored {
                return Err(self.corrupt(at, "not a tar header (checksum mismatch)"));
            }
            let size = h.entry_size().map_err(|e| self.corrupt(at, format!("member size unreadable ({e})")))?;
            let padded = size.div_ceil(BLOCK) * BLOCK;
            // Through gzip the file's length is unknown: a member's size is bounded instead, so a
            // corrupt header cannot ask for more memory than any image needs.
            if self.len == u64::MAX && size > MAX_GZ_MEMBER {
                return Err(self.corrupt(
                    at,
                    format!("a member of {size} bytes, over the {MAX_GZ_MEMBER} bytes a gzip shard's member may have"),
                ));
            }
            if self.pos.saturating_add(size) > self.len {
                return Err(self.corrupt(
                    at,
                    format!("a member of {size} bytes starts at byte {} but the file ends at byte {}", self.pos, self.len),
                ));
            }
            let kind = h.entry_type();
            let wanted = kind.is_file() || kind.is_gnu_longname() || kind.is_pax_local_extensions();
            let mut data = Vec::new();
            if wanted {
                data.resize(size as usize, 0);
                self.read_block(&mut data, "a member's data")?;
                self.skip(padded - size)?;
            } else {
                self.skip(padded)?;
            }
            self.pos += padded;
            if kind.is_gnu_longname() {
                long_name = Some(String::from_utf8_lossy(&data).trim_end_matches('\0').to_string());
                start.get_or_insert(at);
                continue;
            }
            if kind.is_pax_local_extensions() {
                for ext in tar::PaxExtensions::new(&data).flatten() {
                    if ext.key() == Ok("path") {
                        long_name = ext.value().ok().map(str::to_string);
                    }
                }
                start.get_or_insert(at);
                continue;
            }
            if !kind.is_file() {
                long_name = None;
                start = None;
                continue;
            }
            let path = match long_name.take() {
                Some(p) => p,
                None => String::from_utf8_lossy(&h.path_bytes()).into_owned(),
            };
            let path = path.strip_prefix("./").unwrap_or(&path).to_string();
            let first = start.take().unwrap_or(at);
            let Some((key, ext)) = key_and_extension(&path) else { continue };
            return Ok(Some((key.to_string(), ext, first, data)));
        }
    }

    fn skip(&mut self, n: u64) -> DataResult<()> {
        if n == 0 {
            return Ok(());
        }
        match &mut self.reader {
            Source::Plain(r) => r.seek_relative(n as i64).map_err(|e| DataError::io(&self.path, e)),
            Source::Gz(r) => match std::io::copy(&mut r.take(n), &mut std::io::sink()) {
                Ok(k) if k == n => Ok(()),
                Ok(k) => Err(self.corrupt(self.pos, format!("the file ends {k} bytes into a skip of {n}"))),
                Err(e) => Err(self.corrupt(self.pos, format!("the gzip stream does not decode ({e})"))),
            },
        }
    }

    /// The next sample, or `None` after the last.
    pub fn next_sample(&mut self) -> DataResult<Option<Sample>> {
        if let Some((_, e)) = self.deferred.take() {
            self.done = true;
            return Err(e);
        }
        if self.done {
            return Ok(None);
        }
        let first = match self.pending.take() {
            Some(m) => m,
            None => match self.next_member()? {
                Some(m) => m,
                None => {
                    self.done = true;
                    return Ok(None);
                }
            },
        };
        let (key, ext, offset, data) = first;
        let mut sample = Sample { key, offset, members: vec![(ext, data)] };
        loop {
            let at = self.pos;
            let next = match self.next_member() {
                Ok(next) => next,
                Err(e) => {
                    // The sample so far is whole (every member read); the fault comes next.
                    self.deferred = Some((at, e));
                    break;
                }
            };
            match next {
                None => {
                    self.done = true;
                    break;
                }
                Some((key, ext, at, data)) if key == sample.key => {
                    if sample.members.iter().any(|(e, _)| *e == ext) {
                        self.done = true;
                        return Err(self.corrupt(at, format!("sample `{key}` has two `{ext}` members")));
                    }
                    sample.members.push((ext, data));
                }
                Some(next) => {
                    self.pending = Some(next);
                    break;
                }
            }
        }
        Ok(Some(sample))
    }
}
