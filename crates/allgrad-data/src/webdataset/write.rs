//! [`ShardWriter`]: samples into numbered tar shards (`<prefix>-000000.tar`, ...), as
//! webdataset's `ShardWriter` writes them: one member per (key, extension), in sample order,
//! with fixed metadata (mode 0644, owner 0, time 0), so the same samples give the same bytes.
//! A member name over 100 bytes goes in a GNU long-name header (`././@LongLink`) before the
//! member's own; names are UTF-8. webdataset's reader, Python's tarfile and GNU tar read them
//! as written (tested).

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use crate::error::{DataError, DataResult};

/// Writes samples into shards of at most `max_samples` samples each.
pub struct ShardWriter {
    dir: PathBuf,
    prefix: String,
    max_samples: usize,
    current: Option<(PathBuf, tar::Builder<BufWriter<File>>)>,
    in_shard: usize,
    written: Vec<PathBuf>,
}

impl ShardWriter {
    /// Shards `dir/<prefix>-NNNNNN.tar` (NNNNNN from 000000), `max_samples` samples each (at
    /// least 1). Creates `dir`.
    pub fn new(dir: &Path, prefix: &str, max_samples: usize) -> DataResult<Self> {
        std::fs::create_dir_all(dir).map_err(|e| DataError::io(dir, e))?;
        Ok(ShardWriter {
            dir: dir.into(),
            prefix: prefix.into(),
            max_samples: max_samples.max(1),
            current: None,
            in_shard: 0,
            written: Vec::new(),
        })
    }

    /// The brace pattern naming the shards written so far (`<prefix>-{000000..000012}.tar`).
    pub fn pattern(&self) -> String {
        match self.written.len() + self.current.is_some() as usize {
            0 | 1 => format!("{}-000000.tar", self.prefix),
            n => format!("{}-{{000000..{:06}}}.tar", self.prefix, n - 1),
        }
    }

    /// Adds one sample: `key` (no dot, not empty) and its members `(extension, bytes)`.
    pub fn write(&mut self, key: &str, members: &[(&str, &[u8])]) -> DataResult<()> {
        if key.is_empty() || key.rsplit('/').next().is_some_and(|name| name.contains('.')) {
            return Err(DataError::Config {
                field: "webdataset key",
                reason: format!("`{key}`: a key must be non-empty and its file name without a dot"),
            });
        }
        if self.current.is_none() || self.in_shard == self.max_samples {
            self.close_current()?;
            let path = self.dir.join(format!("{}-{:06}.tar", self.prefix, self.written.len()));
            let file = File::create(&path).map_err(|e| DataError::io(&path, e))?;
            let mut builder = tar::Builder::new(BufWriter::new(file));
            builder.mode(tar::HeaderMode::Deterministic);
            self.current = Some((path, builder));
            self.in_shard = 0;
        }
        let (path, builder) = self.current.as_mut().expect("opened above");
        for (ext, bytes) in members {
            let mut header = tar::Header::new_gnu();
            header.set_size(bytes.len() as u64);
            header.set_mode(0o644);
            header.set_mtime(0);
            header.set_entry_type(tar::EntryType::Regular);
            builder.append_data(&mut header, format!("{key}.{ext}"), *bytes).map_err(|e| DataError::io(&*path, e))?;
        }
        self.in_shard += 1;
        Ok(())
    }

    fn close_current(&mut self) -> DataResult<()> {
        if let Some((path, builder)) = self.current.take() {
            let mut out = builder.into_inner().map_err(|e| DataError::io(&path, e))?;
            std::io::Write::flush(&mut out).map_err(|e| DataError::io(&path, e))?;
            self.written.push(path);
        }
        Ok(())
    }

    /// Finishes the last shard (its end-of-archive blocks); the shards written, in order.
    pub fn finish(mut self) -> DataResult<Vec<PathBuf>> {
        self.close_current()?;
        Ok(std::mem::take(&mut self.written))
    }
}
