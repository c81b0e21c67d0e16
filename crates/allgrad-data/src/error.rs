//! The errors of this crate: one variant per way a file, a config or a request can be wrong.
//! Every file error names the file.

use std::path::PathBuf;

/// What went wrong while reading data, building a pipeline or loading a batch.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file or folder could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The operating system's reason.
        source: std::io::Error,
    },

    /// A file starts like gzip (bytes 1f 8b) but its compressed stream is corrupt or cut short.
    #[error("{path}: corrupt or truncated gzip stream: {source}")]
    Gzip {
        /// The file.
        path: PathBuf,
        /// The decompressor's reason.
        source: std::io::Error,
    },

    /// An IDX file's magic number is not the one expected (wrong element type, wrong number
    /// of dimensions, or not an IDX file at all, e.g. images and labels swapped).
    #[error("{path}: IDX magic number is 0x{found:08x}, expected 0x{expected:08x} ({what})")]
    IdxMagic {
        /// The file.
        path: PathBuf,
        /// The magic number read.
        found: u32,
        /// The magic number required.
        expected: u32,
        /// What the expected magic number means, e.g. "unsigned bytes, 3 dimensions".
        what: &'static str,
    },

    /// An IDX header gives dimensions that are zero where they must not be, or whose product
    /// overflows.
    #[error("{path}: IDX dimensions {dims:?} are invalid: {reason}")]
    IdxDims {
        /// The file.
        path: PathBuf,
        /// The dimensions in the header.
        dims: Vec<u32>,
        /// Why they are rejected.
        reason: &'static str,
    },

    /// A file is shorter than its header (or its format) says: it was cut short.
    #[error("{path}: truncated: {found} bytes of data, expected {expected}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Bytes required (after decompression, header included).
        expected: u64,
        /// Bytes present.
        found: u64,
    },

    /// A file is longer than its header says.
    #[error("{path}: {found} bytes of data, the header says {expected}; trailing bytes")]
    TrailingData {
        /// The file.
        path: PathBuf,
        /// Bytes the header accounts for.
        expected: u64,
        /// Bytes present (at least this many).
        found: u64,
    },

    /// An images file and a labels file hold different numbers of items.
    #[error("{images} holds {n_images} images but {labels} holds {n_labels} labels")]
    CountMismatch {
        /// The images file.
        images: PathBuf,
        /// Its item count.
        n_images: usize,
        /// The labels file.
        labels: PathBuf,
        /// Its item count.
        n_labels: usize,
    },

    /// A CIFAR batch file's length is not a whole number of records.
    #[error(
        "{path}: {len} bytes is not a whole number of {record}-byte CIFAR-10 records (truncated or not a CIFAR-10 binary batch)"
    )]
    CifarRecords {
        /// The file.
        path: PathBuf,
        /// Its length.
        len: u64,
        /// The record size (1 label byte + 3072 pixel bytes).
        record: usize,
    },

    /// A label is outside `0..num_classes`.
    #[error("{path}: item {index} has label {label}, outside 0..{num_classes}")]
    LabelOutOfRange {
        /// The file.
        path: PathBuf,
        /// Index of the item within the file.
        index: usize,
        /// The label read.
        label: usize,
        /// The number of classes of the format.
        num_classes: usize,
    },

    /// A dataset source holds no items at all.
    #[error("{path}: no items (empty file or folder)")]
    Empty {
        /// The file or folder.
        path: PathBuf,
    },

    /// An image file could not be decoded (corrupt, truncated, or not PNG/JPEG).
    #[error("{path}: cannot decode image: {source}")]
    Decode {
        /// The image file.
        path: PathBuf,
        /// The decoder's reason.
        source: image::ImageError,
    },

    /// A JPEG could not be decoded (corrupt or truncated: the decoder runs in strict mode, so
    /// a file cut short is an error, never a half-grey image).
    #[error("{path}: cannot decode JPEG: {source}")]
    Jpeg {
        /// The image file (for a sample of a tar shard: `shard.tar:member`).
        path: PathBuf,
        /// The decoder's reason.
        source: zune_jpeg::errors::DecodeErrors,
    },

    /// A RecordIO record that cannot be used: a bad magic number, a length past the end of
    /// the file (an `.idx` offset that does not match the `.rec`), a header too short, a
    /// label that is not a class id.
    #[error("{path}, record at offset {offset}: {reason}")]
    Record {
        /// The `.rec` file.
        path: PathBuf,
        /// Byte offset of the record (or of the part of it at fault).
        offset: u64,
        /// What is wrong, with the value read.
        reason: String,
    },

    /// A line of a RecordIO `.idx` or `property` file that cannot be read.
    #[error("{path}, line {line}: {reason}")]
    RecordIndex {
        /// The file.
        path: PathBuf,
        /// The line (from 1; 0 when the fault is not on one line).
        line: usize,
        /// What is wrong.
        reason: String,
    },

    /// A verification `.bin` file that is not a pickle of `(list of image bytes, list of
    /// bool)` with two images per pair.
    #[error("{path}: not a verification .bin: {reason}")]
    VerificationBin {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// A webdataset shard that does not exist or cannot be opened.
    #[error("webdataset shard {shard}: cannot open: {source}")]
    ShardMissing {
        /// The shard.
        shard: PathBuf,
        /// The operating system's reason.
        source: std::io::Error,
    },

    /// A webdataset shard that is not a well-formed tar archive: cut short, or a header that
    /// is not a tar header.
    #[error("webdataset shard {shard}, byte {offset}: {reason}")]
    Shard {
        /// The shard.
        shard: PathBuf,
        /// Byte offset of the fault (the header of the member concerned).
        offset: u64,
        /// What is wrong.
        reason: String,
    },

    /// A sample of a shard that cannot be used: no image member, a `cls` member that is not
    /// a class id, an image that does not decode.
    #[error("webdataset shard {shard}, sample `{key}` at byte {offset}: {reason}")]
    CorruptSample {
        /// The shard.
        shard: PathBuf,
        /// The sample's key.
        key: String,
        /// Byte offset of the sample's first member header.
        offset: u64,
        /// What is wrong.
        reason: String,
    },

    /// A sample's text (a caption) is missing or could not be turned into token ids.
    #[error("text: {reason}")]
    Text {
        /// What is wrong (the sample, what it lacks or why its text could not be encoded).
        reason: String,
    },

    /// A webdataset stream asked for a position its plan cannot give.
    #[error("webdataset stream: {0}")]
    Stream(String),

    /// The root of an image folder dataset is not a folder, or holds no class sub-folders.
    #[error("{path}: {reason}")]
    NotADataset {
        /// The folder.
        path: PathBuf,
        /// What is missing, e.g. "no class sub-folders".
        reason: &'static str,
    },

    /// A sample index past the end of a dataset.
    #[error("sample index {index} is out of range for a dataset of {len} samples")]
    IndexOutOfRange {
        /// The index asked for.
        index: usize,
        /// The dataset's length.
        len: usize,
    },

    /// Pixel data whose length does not match width x height x channels, or a channel count
    /// other than 1 or 3.
    #[error("image of {width}x{height}x{channels} needs {expected} bytes, got {found} (channels must be 1 or 3)")]
    ImageShape {
        /// Width in pixels.
        width: usize,
        /// Height in pixels.
        height: usize,
        /// Channels.
        channels: usize,
        /// Bytes required.
        expected: usize,
        /// Bytes given.
        found: usize,
    },

    /// A configuration value outside its valid range.
    #[error("invalid config `{field}`: {reason}")]
    Config {
        /// The field, e.g. "crop.scale".
        field: &'static str,
        /// What is wrong, with the value.
        reason: String,
    },

    /// Normalisation statistics do not fit the image's channel count.
    #[error("normalize has {stats} mean/std values but the image has {channels} channel(s); give one value per channel (or a single value for all)")]
    NormalizeChannels {
        /// Length of `mean` (and `std`).
        stats: usize,
        /// Channels of the image.
        channels: usize,
    },

    /// Two samples of one batch came out of the pipeline with different shapes (images of
    /// different sizes without a crop, or mixed grayscale and colour).
    #[error("sample {index} has shape {found:?} (C, H, W) but the batch's first sample has {expected:?}; add a crop or a fixed colour mode so all samples agree")]
    BatchShape {
        /// Global index of the sample that differs.
        index: usize,
        /// Shape of the batch's first sample.
        expected: (usize, usize, usize),
        /// Shape of this sample.
        found: (usize, usize, usize),
    },

    /// An empty list of indices was given as a batch.
    #[error("batch {batch} has no samples")]
    EmptyBatch {
        /// Position of the batch in the loader's plan.
        batch: usize,
    },

    /// A loader worker thread stopped without delivering its batch (it panicked).
    #[error("loader worker {worker} stopped before delivering batch {batch}")]
    WorkerLost {
        /// The worker.
        worker: usize,
        /// The batch it owed.
        batch: usize,
    },

    /// A loader worker thread could not be started.
    #[error("cannot start loader worker {worker}: {source}")]
    Spawn {
        /// The worker.
        worker: usize,
        /// The operating system's reason.
        source: std::io::Error,
    },

    /// A CUDA call of the loader's copies to the device failed.
    #[error("CUDA, {what}: {reason}")]
    Device {
        /// What the loader was doing.
        what: &'static str,
        /// The driver's error.
        reason: String,
    },

    /// Building a tensor failed.
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
}

/// Result with a [`DataError`].
pub type DataResult<T> = Result<T, DataError>;

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        DataError::Io { path: path.into(), source }
    }
}
