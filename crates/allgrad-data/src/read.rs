//! Reading files that may be gzipped (detected by the gzip magic bytes, not the file name),
//! with errors that name the file and never allocating more than the data present.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use flate2::read::GzDecoder;

use crate::error::{DataError, DataResult};

/// A byte source over a plain or gzipped file.
pub(crate) struct Source {
    path: PathBuf,
    gzip: bool,
    inner: Box<dyn Read + Send>,
}

impl Source {
    /// Opens `path`, decompressing on the fly when it starts with the gzip magic 1f 8b.
    pub(crate) fn open(path: &Path) -> DataResult<Self> {
        let mut file = File::open(path).map_err(|e| DataError::io(path, e))?;
        let mut magic = [0u8; 2];
        let n = read_full(&mut file, &mut magic).map_err(|e| DataError::io(path, e))?;
        let head = std::io::Cursor::new(magic[..n].to_vec());
        let gzip = n == 2 && magic == [0x1f, 0x8b];
        let chained = head.chain(BufReader::new(file));
        let inner: Box<dyn Read + Send> = if gzip { Box::new(GzDecoder::new(chained)) } else { Box::new(chained) };
        Ok(Source { path: path.to_path_buf(), gzip, inner })
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Up to `limit` bytes (fewer only at the end of the data). Memory grows with the data
    /// actually read, so a header claiming a huge size cannot make it allocate.
    pub(crate) fn read_up_to(&mut self, limit: u64) -> DataResult<Vec<u8>> {
        let mut out = Vec::new();
        match (&mut self.inner).take(limit).read_to_end(&mut out) {
            Ok(_) => Ok(out),
            Err(e) => Err(self.error(e)),
        }
    }

    /// Everything left.
    pub(crate) fn read_all(&mut self) -> DataResult<Vec<u8>> {
        self.read_up_to(u64::MAX)
    }

    fn error(&self, e: std::io::Error) -> DataError {
        if self.gzip {
            DataError::Gzip { path: self.path.clone(), source: e }
        } else {
            DataError::io(&self.path, e)
        }
    }
}

/// Reads until `buf` is full or the reader ends; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}
