//! Reading safetensors checkpoints: one file, or a Hugging Face directory whose
//! `model.safetensors.index.json` spreads the tensors over several files.
//!
//! Headers are parsed and validated by the `safetensors` crate (offsets contiguous and in range,
//! byte ranges matching dtype and shape, no overflow); on top of that we refuse duplicate tensor
//! names, a file whose length differs from what its header describes, and index entries that
//! leave the checkpoint directory or disagree with the files.
//!
//! Two read paths: `Mmap` maps each file read-only (`MAP_PRIVATE`) and hands out borrowed byte
//! ranges; `Pread` keeps a file handle and copies each tensor out with positioned reads, for
//! network filesystems where page faults on a mapping are slow or unreliable.
//!
//! A file that changes while it is open: its length is checked against its header at open (and
//! the mapping against that length). Later, each `read` checks the file's current length first,
//! so a file truncated before a tensor is read gives an error on both backends. With `Pread` a
//! truncation during the read is an error too. With `Mmap`, a tensor already handed out still
//! borrows the mapping: touching its lost pages after a truncation raises SIGBUS (the kernel's
//! rule for mappings), which no library can turn into an error; use `Pread` where files may be
//! truncated or rewritten in place. A file replaced by rename (the usual atomic rewrite) is safe
//! on both backends: the open handle and mapping keep the old contents.
//!
//! Unix only (positioned reads with `FileExt::read_exact_at`), as is the package: its writer
//! locks output directories with `flock`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use memmap2::{Mmap, MmapOptions, UncheckedAdvice};
use rayon::prelude::*;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::SafeTensorError;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};

use crate::error::{Error, Result};

/// The index file of a sharded Hugging Face checkpoint.
pub const INDEX_NAME: &str = "model.safetensors.index.json";
/// The largest header the safetensors format allows, in bytes.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// How tensor bytes are read from disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Map each file read-only and borrow from the mapping (zero copy).
    Mmap,
    /// Copy each tensor out with positioned reads; nothing is mapped.
    Pread,
}

enum Storage {
    /// The mapping, and the file handle (kept to check the file's length before each read).
    Mapped(Arc<Mmap>, File),
    File(File),
}

/// The bytes of one tensor: a range of a shared mapping, or an owned copy.
pub enum TensorData {
    /// `range` of the file mapping `map` (which the value keeps alive).
    Mapped { map: Arc<Mmap>, range: Range<usize> },
    /// A copy read from the file.
    Owned(Vec<u8>),
}

impl TensorData {
    /// The tensor's raw little-endian bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Self::Mapped { map, range } => &map[range.clone()],
            Self::Owned(bytes) => bytes,
        }
    }
}

/// One open, validated safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    /// Offset of the data section: 8 + header length.
    data_start: usize,
    metadata: Metadata,
    storage: Storage,
    /// Bytes read from the file with read calls: the header at open, then (`Pread`) tensor data.
    bytes_read: AtomicU64,
}

impl SafetensorsFile {
    /// Opens and validates `path`.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be opened or read; [`Error::Safetensors`] for a file
    /// shorter than 8 bytes, a header length past the file or above 100 MB, a header that is not
    /// valid UTF-8 JSON of the safetensors shape, duplicate tensor names, invalid offsets, and a
    /// file length that differs from what the header describes.
    pub fn open(path: &Path, backend: Backend) -> Result<Self> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let bad = |reason: String| Error::Safetensors {
            path: path.to_path_buf(),
            reason,
        };
        let file = open_regular_file(path)?;
        let file_len = file.metadata().map_err(io)?.len();
        if file_len < 8 {
            return Err(bad(format!(
                "the file is {file_len} bytes, shorter than the 8-byte header length"
            )));
        }
        let mut len_bytes = [0u8; 8];
        read_exact_at(&file, &mut len_bytes, 0).map_err(io)?;
        let header_len = u64::from_le_bytes(len_bytes);
        if header_len > MAX_HEADER_BYTES {
            return Err(bad(format!(
                "header length {header_len} bytes exceeds the format's {MAX_HEADER_BYTES}-byte limit"
            )));
        }
        if header_len > file_len - 8 {
            return Err(bad(format!(
                "header length {header_len} bytes runs past the end of the {file_len}-byte file"
            )));
        }
        // Fits in usize: bounded by MAX_HEADER_BYTES.
        let mut header = vec![0u8; header_len as usize];
        read_exact_at(&file, &mut header, 8).map_err(io)?;
        let metadata = parse_header(path, &header, file_len - 8 - header_len)?;
        let storage = match backend {
            Backend::Mmap => {
                // SAFETY: a read-only private mapping. If another process truncates the file
                // while it is mapped, reads of the lost pages raise SIGBUS (see the module
                // docs); the length was checked against the header just now, and the mapping's
                // length is checked against it below.
                let map = unsafe { MmapOptions::new().map_copy_read_only(&file) }.map_err(io)?;
                if map.len() as u64 != file_len {
                    return Err(bad(format!(
                        "the file changed size while it was being opened ({file_len} bytes, \
                         then {})",
                        map.len()
                    )));
                }
                Storage::Mapped(Arc::new(map), file)
            }
            Backend::Pread => Storage::File(file),
        };
        Ok(Self {
            path: path.to_path_buf(),
            data_start: 8 + header_len as usize,
            metadata,
            storage,
            bytes_read: AtomicU64::new(8 + header_len),
        })
    }

    /// Bytes read from this file with read calls since it was opened: the 8-byte length and
    /// the header, plus, with `Pread`, every tensor byte read. Pages of a `Mmap` mapping reach
    /// the process through page faults and are not counted.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensor names in data-offset order.
    pub fn names(&self) -> Vec<String> {
        self.metadata.offset_keys()
    }

    /// Dtype, shape and offsets of one tensor.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.metadata.info(name)
    }

    /// The `__metadata__` string map of the header.
    pub fn user_metadata(&self) -> Option<&std::collections::HashMap<String, String>> {
        self.metadata.metadata().as_ref()
    }

    /// The address range of the mapping, when the file is mapped (used to prove zero copy).
    pub fn mapping(&self) -> Option<Range<usize>> {
        match &self.storage {
            Storage::Mapped(map, _) => {
                Some(map.as_ptr() as usize..map.as_ptr() as usize + map.len())
            }
            Storage::File(_) => None,
        }
    }

    /// The open file and the absolute byte range in it of bytes `part` of tensor `name`
    /// (offsets within the tensor; `part.end` is clamped to the tensor's length), for copies the
    /// kernel does file to file (`copy_file_range`, `sendfile`) from the file this value opened,
    /// even if the path has since been replaced. `None` for an unknown name or a `part` that
    /// starts past the tensor.
    pub fn file_range(&self, name: &str, part: Range<usize>) -> Option<(&File, Range<u64>)> {
        let (begin, end) = self.info(name)?.data_offsets;
        let part = part.start..part.end.min(end - begin);
        if part.start > part.end {
            return None;
        }
        let file = match &self.storage {
            Storage::Mapped(_, file) | Storage::File(file) => file,
        };
        let start = (self.data_start + begin + part.start) as u64;
        Some((file, start..start + part.len() as u64))
    }

    /// Drops this process's resident pages of tensor `name` from the mapping (the kernel's page
    /// cache keeps them), so a streaming pass over a large checkpoint does not grow the resident
    /// set. Arrays already viewing the tensor stay valid: their next access maps the pages again
    /// from the file, which has not changed. Only whole 64 KiB blocks inside the tensor are
    /// dropped; a no-op for `Pread` and for unknown names.
    pub fn release(&self, name: &str) {
        const BLOCK: usize = 64 << 10;
        let (Storage::Mapped(map, _), Some(info)) = (&self.storage, self.info(name)) else {
            return;
        };
        let start = (self.data_start + info.data_offsets.0).next_multiple_of(BLOCK);
        let end = (self.data_start + info.data_offsets.1) / BLOCK * BLOCK;
        if start < end {
            // SAFETY: the mapping is private and read-only, so it has no dirty pages: after
            // MADV_DONTNEED every access repopulates the same bytes from the unchanged file, and
            // borrows of the range keep reading valid data. A failure only means the pages stay.
            let _ = unsafe {
                map.unchecked_advise_range(UncheckedAdvice::DontNeed, start, end - start)
            };
        }
    }

    /// The bytes of tensor `name`.
    ///
    /// The file's current length is checked first, so a file truncated since it was opened
    /// gives an error instead of a short read (or, with `Mmap`, a SIGBUS).
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::Checkpoint`] when the file is now too short for the
    /// tensor (truncated while open); [`Error::Io`] when a read fails otherwise.
    pub fn read(&self, name: &str) -> Result<TensorData> {
        self.read_range(name, 0..usize::MAX)
    }

    /// Bytes `part` of tensor `name` (offsets within the tensor; `part.end` is clamped to the
    /// tensor's length). With `Pread` only those bytes are read, so a rank reading its row
    /// slice reads `1/tp_size` of the tensor.
    ///
    /// # Errors
    /// As [`Self::read`], plus [`Error::Checkpoint`] when `part.start` lies past the tensor.
    pub fn read_range(&self, name: &str, part: Range<usize>) -> Result<TensorData> {
        let info = self.info(name).ok_or_else(|| Error::TensorNotFound {
            path: self.path.clone(),
            name: name.to_string(),
        })?;
        let (begin, end) = info.data_offsets;
        let part = part.start..part.end.min(end - begin);
        if part.start > part.end {
            return Err(Error::Checkpoint {
                path: self.path.clone(),
                reason: format!(
                    "tensor {name:?}: byte range {}..{} is empty or past its {} bytes",
                    part.start,
                    part.end,
                    end - begin
                ),
            });
        }
        // In range: the header was checked against the file's length at open.
        let range = self.data_start + begin + part.start..self.data_start + begin + part.end;
        let io = |source| Error::Io {
            path: self.path.clone(),
            source,
        };
        let truncated = |now: String| Error::Checkpoint {
            path: self.path.clone(),
            reason: format!(
                "tensor {name:?} (file bytes {}..{}) cannot be read: the file is {now}, shorter \
                 than when it was opened (truncated or rewritten in place while open)",
                range.start, range.end
            ),
        };
        let file = match &self.storage {
            Storage::Mapped(_, file) | Storage::File(file) => file,
        };
        let len_now = file.metadata().map_err(io)?.len();
        if len_now < range.end as u64 {
            return Err(truncated(format!("now {len_now} bytes")));
        }
        match &self.storage {
            Storage::Mapped(map, _) => Ok(TensorData::Mapped {
                map: Arc::clone(map),
                range,
            }),
            Storage::File(file) => {
                let mut bytes = vec![0u8; range.len()];
                read_exact_at(file, &mut bytes, range.start as u64).map_err(|source| {
                    if source.kind() == std::io::ErrorKind::UnexpectedEof {
                        truncated("cut short during the read".to_string())
                    } else {
                        io(source)
                    }
                })?;
                self.bytes_read
                    .fetch_add(range.len() as u64, Ordering::Relaxed);
                Ok(TensorData::Owned(bytes))
            }
        }
    }

    /// `count` spans of `span` bytes of tensor `name`, the first at byte `start` of the tensor
    /// and each next one `stride` bytes further, concatenated into one buffer of
    /// `count * span` bytes. This is a column block of a row-major matrix: for rows of
    /// `stride` bytes, the columns `[start, start + span)` of every row.
    ///
    /// With `Pread` only those bytes are read: one positioned read per span (one read in all
    /// when the spans touch, `span == stride`), spread over the rayon pool for large outputs.
    /// With `Mmap` the spans are copied out of the mapping.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::Checkpoint`] when `span > stride` (with several
    /// spans), when the last span ends past the tensor (its end offset overflowing `usize`
    /// included: no arguments panic or allocate more than the tensor), or when the file is now too short
    /// (truncated while open); [`Error::Io`] when a read fails otherwise.
    pub fn read_spans(
        &self,
        name: &str,
        start: usize,
        span: usize,
        stride: usize,
        count: usize,
    ) -> Result<TensorData> {
        let info = self.info(name).ok_or_else(|| Error::TensorNotFound {
            path: self.path.clone(),
            name: name.to_string(),
        })?;
        let tensor_len = info.data_offsets.1 - info.data_offsets.0;
        let bad = |reason: String| Error::Checkpoint {
            path: self.path.clone(),
            reason: format!("tensor {name:?}: {reason}"),
        };
        if count > 1 && span > stride {
            return Err(bad(format!(
                "spans of {span} bytes every {stride} bytes overlap"
            )));
        }
        // The end of the last span; no spans end where they start.
        let end = match count.checked_sub(1) {
            None => Some(start),
            Some(n) => n
                .checked_mul(stride)
                .and_then(|n| n.checked_add(start))
                .and_then(|n| n.checked_add(span)),
        };
        let Some(end) = end else {
            return Err(bad(format!(
                "{count} spans of {span} bytes every {stride} bytes from byte {start} end past \
                 its {tensor_len} bytes (the end offset overflows a {}-bit size)",
                usize::BITS
            )));
        };
        if end > tensor_len || start > tensor_len {
            return Err(bad(format!(
                "{count} spans of {span} bytes every {stride} bytes from byte {start} end at \
                 byte {end}, past its {tensor_len} bytes"
            )));
        }
        // No overflow below: `count * span <= end - start` when the spans do not overlap.
        if count <= 1 || span == 0 || span == stride {
            return self.read_range(name, start..start + count * span);
        }
        let total = count * span;
        let base = self.data_start + info.data_offsets.0 + start;
        let last = self.data_start + info.data_offsets.0 + end;
        let file = match &self.storage {
            Storage::Mapped(_, file) | Storage::File(file) => file,
        };
        let len_now = file
            .metadata()
            .map_err(|source| Error::Io {
                path: self.path.clone(),
                source,
            })?
            .len();
        if len_now < last as u64 {
            return Err(bad(format!(
                "file bytes up to {last} cannot be read: the file is now {len_now} bytes, \
                 shorter than when it was opened (truncated or rewritten in place while open)"
            )));
        }
        let mut out = vec![0u8; total];
        match &self.storage {
            Storage::Mapped(map, _) => {
                for (i, dst) in out.chunks_exact_mut(span).enumerate() {
                    let from = base + i * stride;
                    dst.copy_from_slice(&map[from..from + span]);
                }
            }
            Storage::File(file) => {
                // About 1 MiB of output per task, whole spans.
                let spans_per_task = ((1usize << 20) / span.max(1)).max(1);
                let read = |(task, chunk): (usize, &mut [u8])| -> std::io::Result<()> {
                    for (i, dst) in chunk.chunks_exact_mut(span).enumerate() {
                        let offset = base + (task * spans_per_task + i) * stride;
                        read_exact_at(file, dst, offset as u64)?;
                    }
                    Ok(())
                };
                let chunks = out.chunks_mut(spans_per_task * span).enumerate();
                let done: std::io::Result<()> = if total >= PARALLEL_SPAN_BYTES {
                    chunks
                        .collect::<Vec<_>>()
                        .into_par_iter()
                        .try_for_each(read)
                } else {
                    chunks.into_iter().try_for_each(read)
                };
                done.map_err(|source| {
                    if source.kind() == std::io::ErrorKind::UnexpectedEof {
                        bad("cut short during the read (the file was truncated while open)".into())
                    } else {
                        Error::Io {
                            path: self.path.clone(),
                            source,
                        }
                    }
                })?;
                self.bytes_read.fetch_add(total as u64, Ordering::Relaxed);
            }
        }
        Ok(TensorData::Owned(out))
    }
}

/// Below this many output bytes, `read_spans` reads on the calling thread.
const PARALLEL_SPAN_BYTES: usize = 4 << 20;

/// A whole checkpoint: one safetensors file, or a directory of them.
pub struct Checkpoint {
    root: PathBuf,
    files: Vec<SafetensorsFile>,
    /// Tensor name → index into `files`.
    index: BTreeMap<String, usize>,
}

impl Checkpoint {
    /// Opens a `.safetensors` file, or a directory holding `model.safetensors.index.json` and
    /// the files it names, or a directory holding exactly one `.safetensors` file.
    ///
    /// # Errors
    /// Everything [`SafetensorsFile::open`] refuses, plus [`Error::Checkpoint`] for an index
    /// that is not JSON, lacks `weight_map`, names a file outside the directory, maps a tensor
    /// to a file that lacks it, or leaves a file's tensor unlisted; a tensor held by two files;
    /// and a directory with no (or, without an index, several) safetensors files.
    pub fn open(path: &Path, backend: Backend) -> Result<Self> {
        if !path.is_dir() {
            let file = SafetensorsFile::open(path, backend)?;
            let root = path.parent().unwrap_or(Path::new(".")).to_path_buf();
            return Self::from_files(root, vec![file]);
        }
        let index_path = path.join(INDEX_NAME);
        if index_path.exists() {
            return Self::open_index(path, &index_path, backend);
        }
        let inconsistent = |reason: String| Error::Checkpoint {
            path: path.to_path_buf(),
            reason,
        };
        let mut candidates = Vec::new();
        for entry in std::fs::read_dir(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })? {
            let entry = entry.map_err(|source| Error::Io {
                path: path.to_path_buf(),
                source,
            })?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".safetensors") && !name.starts_with('.') {
                candidates.push(entry.path());
            }
        }
        match candidates.as_slice() {
            [one] => {
                let file = SafetensorsFile::open(one, backend)?;
                Self::from_files(path.to_path_buf(), vec![file])
            }
            [] => Err(inconsistent("no .safetensors file in the directory".into())),
            _ => Err(inconsistent(format!(
                "{} .safetensors files and no {INDEX_NAME} to say which tensor is where",
                candidates.len()
            ))),
        }
    }

    fn open_index(root: &Path, index_path: &Path, backend: Backend) -> Result<Self> {
        let bad = |reason: String| Error::Checkpoint {
            path: index_path.to_path_buf(),
            reason,
        };
        let io = |source| Error::Io {
            path: index_path.to_path_buf(),
            source,
        };
        let file = open_regular_file(index_path)?;
        let len = file.metadata().map_err(io)?.len();
        if len > MAX_INDEX_BYTES {
            return Err(bad(format!(
                "the index is {len} bytes, more than the {MAX_INDEX_BYTES} bytes kda_tp reads \
                 (a safetensors header's own limit); not a checkpoint index"
            )));
        }
        let mut text = Vec::new();
        file.take(MAX_INDEX_BYTES + 1)
            .read_to_end(&mut text)
            .map_err(io)?;
        let WeightMap {
            file_names,
            wanted,
            first_tensor,
        } = parse_index(index_path, &text)?;
        let mut files = Vec::with_capacity(file_names.len());
        for file in &file_names {
            let full = root.join(file);
            // The name itself stays inside the directory (checked above); a symlink there is
            // followed wherever it points, as in the Hugging Face cache (snapshots/ -> blobs/).
            if !full.exists() {
                return Err(bad(format!(
                    "weight_map[{:?}] = {file:?}, which does not exist ({})",
                    first_tensor.get(file).map_or("?", String::as_str),
                    full.display()
                )));
            }
            files.push(SafetensorsFile::open(&full, backend)?);
        }
        for (tensor, file) in &wanted {
            let position = file_names.binary_search(file).unwrap_or_default();
            if files[position].info(tensor).is_none() {
                return Err(bad(format!(
                    "maps tensor {tensor:?} to {file}, which has no such tensor"
                )));
            }
        }
        for (file_name, file) in file_names.iter().zip(&files) {
            for tensor in file.names() {
                if wanted.get(tensor.as_str()) != Some(file_name) {
                    return Err(bad(format!(
                        "{file_name} holds tensor {tensor:?}, which the index maps to {}",
                        wanted
                            .get(tensor.as_str())
                            .map_or("no file", String::as_str)
                    )));
                }
            }
        }
        Self::from_files(root.to_path_buf(), files)
    }

    fn from_files(root: PathBuf, files: Vec<SafetensorsFile>) -> Result<Self> {
        let mut index = BTreeMap::new();
        for (position, file) in files.iter().enumerate() {
            for name in file.names() {
                if let Some(previous) = index.insert(name.clone(), position) {
                    return Err(Error::Checkpoint {
                        path: root,
                        reason: format!(
                            "tensor {name:?} is in both {} and {}",
                            files[previous].path().display(),
                            file.path().display()
                        ),
                    });
                }
            }
        }
        Ok(Self { root, files, index })
    }

    /// The checkpoint directory (the file's directory for a single file).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The open files, in file-name order.
    pub fn files(&self) -> &[SafetensorsFile] {
        &self.files
    }

    /// Every tensor name: file by file, each in data-offset order.
    pub fn names(&self) -> Vec<String> {
        self.files.iter().flat_map(SafetensorsFile::names).collect()
    }

    /// The file holding `name` and the tensor's header entry.
    pub fn locate(&self, name: &str) -> Option<(&SafetensorsFile, &TensorInfo)> {
        let file = &self.files[*self.index.get(name)?];
        Some((file, file.info(name)?))
    }

    /// Drops the resident pages of tensor `name` (see [`SafetensorsFile::release`]).
    pub fn release(&self, name: &str) {
        if let Some((file, _)) = self.locate(name) {
            file.release(name);
        }
    }

    /// The bytes of tensor `name`.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::Io`] when a positioned read fails.
    pub fn read(&self, name: &str) -> Result<TensorData> {
        self.read_range(name, 0..usize::MAX)
    }

    /// Bytes read from the checkpoint's files with read calls (see
    /// [`SafetensorsFile::bytes_read`]), summed over the files.
    pub fn bytes_read(&self) -> u64 {
        self.files.iter().map(SafetensorsFile::bytes_read).sum()
    }

    /// Spans of tensor `name` (see [`SafetensorsFile::read_spans`]).
    ///
    /// # Errors
    /// As [`SafetensorsFile::read_spans`].
    pub fn read_spans(
        &self,
        name: &str,
        start: usize,
        span: usize,
        stride: usize,
        count: usize,
    ) -> Result<TensorData> {
        match self.locate(name) {
            Some((file, _)) => file.read_spans(name, start, span, stride, count),
            None => Err(Error::TensorNotFound {
                path: self.root.clone(),
                name: name.to_string(),
            }),
        }
    }

    /// Bytes `part` of tensor `name` (see [`SafetensorsFile::read_range`]).
    ///
    /// # Errors
    /// As [`SafetensorsFile::read_range`].
    pub fn read_range(&self, name: &str, part: Range<usize>) -> Result<TensorData> {
        match self.locate(name) {
            Some((file, _)) => file.read_range(name, part),
            None => Err(Error::TensorNotFound {
                path: self.root.clone(),
                name: name.to_string(),
            }),
        }
    }
}

/// Parses and validates the JSON header of a safetensors file, from memory (no file I/O).
///
/// `header` is the header's bytes (what follows the 8-byte length prefix, `header.len()` being
/// that length) and `data_len` the number of bytes after the header in the file. Checks what
/// [`SafetensorsFile::open`] promises about a header: UTF-8, a JSON object, no name twice, a
/// `__metadata__` string map (or `null`, read as no metadata), every tensor entry a known dtype
/// with a shape whose byte size (sub-byte dtypes such as F4 included, by bits) equals its
/// `data_offsets` range (no overflow), the tensors back to back from data byte 0
/// with no gap or overlap, and their total exactly `data_len` (neither past the end of the file
/// nor followed by trailing bytes). Errors are [`Error::Safetensors`] naming `path` and, where
/// there is one, the tensor. Public so that fuzzers can drive header parsing from memory.
///
/// One validator: the entries' sizes and offsets are checked once, by the safetensors crate
/// (`Metadata::new`); this function checks only what that does not (JSON shape, duplicate
/// names, the metadata map, the data section's length), and words a refusal of the crate's
/// (which names no tensor or offset) for the user ([`explain_refusal`], on that path only).
///
/// # Errors
/// [`Error::Safetensors`] for each refusal above.
pub fn parse_header(path: &Path, header: &[u8], data_len: u64) -> Result<Metadata> {
    let bad = |reason: String| Error::Safetensors {
        path: path.to_path_buf(),
        reason,
    };
    let (user_metadata, tensors) = header_entries(path, header)?;
    let metadata = Metadata::new(user_metadata, tensors)
        .map_err(|refusal| explain_refusal(path, header, &refusal))?;
    // Back to back from data byte 0 (checked above): the data section is the last end offset.
    let described = metadata.data_len();
    let prefix = 8 + header.len() as u128;
    let file_len = prefix + u128::from(data_len);
    let described_total = prefix + described as u128;
    if described as u128 > u128::from(data_len) {
        let (name, end) = metadata
            .offset_keys()
            .into_iter()
            .filter_map(|name| {
                let end = metadata.info(&name)?.data_offsets.1;
                (end as u128 > u128::from(data_len)).then_some((name, end))
            })
            .next()
            .unwrap_or_default();
        return Err(bad(format!(
            "the header describes {described_total} bytes but the file has {file_len} \
             (truncated: tensor {name:?} ends at data byte {end}, past the {data_len} data bytes \
             after the header)"
        )));
    }
    if (described as u128) < u128::from(data_len) {
        return Err(bad(format!(
            "the header describes {described_total} bytes but the file has {file_len} \
             ({} trailing bytes after the data)",
            u128::from(data_len) - described as u128
        )));
    }
    Ok(metadata)
}

/// A header's `__metadata__` map and its tensor entries, in data order.
type ParsedHeader = (Option<HashMap<String, String>>, Vec<(String, TensorInfo)>);

/// The header's `__metadata__` map and its tensor entries in data order (by offsets, then by
/// name, so that the order is deterministic): the checks that are not the safetensors crate's
/// (UTF-8, a JSON object, no name twice, the metadata a map of strings, each entry's fields).
fn header_entries(path: &Path, header: &[u8]) -> Result<ParsedHeader> {
    let text = std::str::from_utf8(header).map_err(|e| Error::Safetensors {
        path: path.to_path_buf(),
        reason: format!("header is not UTF-8: {e}"),
    })?;
    // Something is wrong when the fast path gives up: parsed again, as JSON values entry by
    // entry, for the message.
    typed_entries(text).map_or_else(|| value_entries(path, text), Ok)
}

/// [`header_entries`]' slow path, which finds what is wrong: the header as JSON values (every
/// key seen, in document order), then each entry converted and refused with its name.
fn value_entries(path: &Path, text: &str) -> Result<ParsedHeader> {
    let bad = |reason: String| Error::Safetensors {
        path: path.to_path_buf(),
        reason,
    };
    let HeaderEntries { entries, duplicate } =
        serde_json::from_str(text).map_err(|e| bad(format!("header is not a JSON object: {e}")))?;
    if let Some(name) = duplicate {
        return Err(bad(format!("tensor {name:?} appears twice in the header")));
    }
    let mut user_metadata = None;
    let mut tensors: Vec<(String, TensorInfo)> = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        if name == METADATA_KEY {
            // `null` is no metadata, as the reference reader has it (its field is an Option).
            if value.is_null() {
                continue;
            }
            let map = HashMap::<String, String>::deserialize(value).map_err(|e| {
                bad(format!(
                    "invalid header: {METADATA_KEY:?} is not a map of strings to strings: {e}"
                ))
            })?;
            user_metadata = Some(map);
            continue;
        }
        let info = TensorInfo::deserialize(value)
            .map_err(|e| bad(format!("invalid header: tensor {name:?}: {e}")))?;
        tensors.push((name, info));
    }
    tensors.sort_by(|(a, x), (b, y)| (x.data_offsets, a).cmp(&(y.data_offsets, b)));
    Ok((user_metadata, tensors))
}

/// Words a refusal of the safetensors crate's validation for the user: the first tensor, in
/// data order, that the crate refuses (its checks in its order: offsets that end before they
/// begin, overlap the previous tensor or leave a gap after it, then a byte size that overflows,
/// is not whole bytes or differs from the offsets), with its name and numbers. Runs only after
/// the crate refused, so a valid header is checked once.
fn explain_refusal(path: &Path, header: &[u8], refusal: &SafeTensorError) -> Error {
    let bad = |reason: String| Error::Safetensors {
        path: path.to_path_buf(),
        reason: format!("invalid header: {reason}"),
    };
    let tensors = match header_entries(path, header) {
        Ok((_, tensors)) => tensors,
        Err(e) => return e,
    };
    let mut described = 0usize;
    let mut previous: Option<&str> = None;
    for (name, info) in &tensors {
        let (begin, end) = info.data_offsets;
        let after = previous.map_or_else(
            || "the start of the data section".to_string(),
            |p| format!("tensor {p:?}"),
        );
        if end < begin {
            return bad(format!(
                "tensor {name:?} has data_offsets [{begin}, {end}], which end before they begin"
            ));
        }
        if begin < described {
            return bad(format!(
                "tensor {name:?} (data bytes [{begin}, {end})) overlaps {after}, which ends at \
                 data byte {described}"
            ));
        }
        if begin > described {
            return bad(format!(
                "a gap of {} bytes between {after} (ending at data byte {described}) and tensor \
                 {name:?} (starting at {begin})",
                begin - described
            ));
        }
        let bits = info
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_mul(info.dtype.bitsize()));
        let (shape, dtype) = (&info.shape, info.dtype);
        match bits {
            None => {
                return bad(format!(
                    "tensor {name:?}: shape {shape:?} of {dtype} overflows the byte size"
                ))
            }
            Some(bits) if bits % 8 != 0 => {
                return bad(format!(
                    "tensor {name:?}: shape {shape:?} of {dtype} is {bits} bits, not a whole \
                     number of bytes"
                ))
            }
            Some(bits) if bits / 8 != end - begin => {
                return bad(format!(
                    "tensor {name:?}: shape {shape:?} of {dtype} is {} bytes, but its \
                     data_offsets [{begin}, {end}] span {} bytes",
                    bits / 8,
                    end - begin
                ))
            }
            Some(_) => {}
        }
        described = end;
        previous = Some(name);
    }
    bad(refusal.to_string())
}

const METADATA_KEY: &str = "__metadata__";

/// Largest `model.safetensors.index.json` read, in bytes: 100 MB, the safetensors crate's limit
/// on one header (a real index of 100,000 tensors is about 10 MB).
pub const MAX_INDEX_BYTES: u64 = 100_000_000;

/// The `weight_map` of a `model.safetensors.index.json`, checked (see [`parse_index`]).
#[derive(Debug)]
pub struct WeightMap {
    /// The distinct file names, sorted.
    pub file_names: Vec<String>,
    /// Tensor name -> file name.
    pub wanted: BTreeMap<String, String>,
    /// File name -> the first tensor (in document order) mapped to it, named in errors.
    pub first_tensor: HashMap<String, String>,
}

/// Parses and checks a `model.safetensors.index.json` from memory (no file I/O): JSON (nested
/// at most serde_json's 128 levels), a `"weight_map"` object whose every value is a plain
/// relative file name (no `..`, no root, not empty). Linear in the document: each file name is
/// looked up in a hash map, not in the list of names seen. Public so that fuzzers can drive
/// it; [`Checkpoint::open`] then checks the files against it.
///
/// # Errors
/// [`Error::Checkpoint`] naming `index_path`, for each refusal above.
pub fn parse_index(index_path: &Path, text: &[u8]) -> Result<WeightMap> {
    let bad = |reason: String| Error::Checkpoint {
        path: index_path.to_path_buf(),
        reason,
    };
    let json: serde_json::Value =
        serde_json::from_slice(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let weight_map = json
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
    let mut first_tensor: HashMap<String, String> = HashMap::new();
    let mut wanted = BTreeMap::new();
    for (tensor, file) in weight_map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("weight_map[{tensor:?}] is not a file name")))?;
        let relative = Path::new(file);
        if file.is_empty()
            || !relative
                .components()
                .all(|c| matches!(c, Component::Normal(_)))
        {
            return Err(bad(format!(
                "weight_map[{tensor:?}] = {file:?} is not a plain relative path inside the \
                 checkpoint directory"
            )));
        }
        first_tensor
            .entry(file.to_string())
            .or_insert_with(|| tensor.clone());
        wanted.insert(tensor.clone(), file.to_string());
    }
    let mut file_names: Vec<String> = first_tensor.keys().cloned().collect();
    file_names.sort_unstable();
    Ok(WeightMap {
        file_names,
        wanted,
        first_tensor,
    })
}

/// Opens `path` for reading if it is a regular file. Anything else (a directory, a FIFO, a
/// socket, a device) is refused before it is opened: opening a FIFO would block forever.
///
/// # Errors
/// [`Error::Io`]: the file cannot be opened, or is not a regular file (`InvalidInput`).
pub fn open_regular_file(path: &Path) -> Result<File> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let not_regular = || {
        io(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a directory, FIFO, socket or device cannot be read as a \
             checkpoint file)",
        ))
    };
    if !std::fs::metadata(path).map_err(io)?.is_file() {
        return Err(not_regular());
    }
    let file = File::open(path).map_err(io)?;
    // Again on the open handle, in case the path changed in between.
    if !file.metadata().map_err(io)?.is_file() {
        return Err(not_regular());
    }
    Ok(file)
}

/// [`header_entries`]' fast path: the entries parsed straight into their types, in one pass with
/// no intermediate JSON values (about half the time on a header of 70,000 names), sorted in
/// data order. `None` for anything it does not accept: a duplicate name, a malformed entry,
/// not a JSON object; the slow path then finds and words the refusal.
fn typed_entries(text: &str) -> Option<ParsedHeader> {
    struct Typed;
    impl<'de> Visitor<'de> for Typed {
        type Value = ParsedHeader;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ParsedHeader, A::Error> {
            let mut user_metadata: Option<Option<HashMap<String, String>>> = None;
            let mut tensors = Vec::with_capacity(map.size_hint().unwrap_or(0));
            while let Some(key) = map.next_key::<String>()? {
                if key == METADATA_KEY {
                    if user_metadata.is_some() {
                        return Err(serde::de::Error::custom("__metadata__ twice"));
                    }
                    user_metadata = Some(map.next_value()?);
                } else {
                    tensors.push((key, map.next_value::<TensorInfo>()?));
                }
            }
            Ok((user_metadata.flatten(), tensors))
        }
    }
    let mut json = serde_json::Deserializer::from_str(text);
    let (user_metadata, mut tensors) = (&mut json).deserialize_map(Typed).ok()?;
    // Nothing but whitespace after the object, as `serde_json::from_str` (the slow path) has it.
    json.end().ok()?;
    let mut seen = HashSet::with_capacity(tensors.len());
    if !tensors.iter().all(|(name, _)| seen.insert(name.as_str())) {
        return None;
    }
    tensors.sort_by(|(a, x), (b, y)| (x.data_offsets, a).cmp(&(y.data_offsets, b)));
    Some((user_metadata, tensors))
}

/// A JSON object's entries in document order, and the first key seen twice (serde_json's own
/// maps would silently keep the last of two equal keys).
struct HeaderEntries {
    entries: Vec<(String, serde_json::Value)>,
    duplicate: Option<String>,
}

impl<'de> Deserialize<'de> for HeaderEntries {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = HeaderEntries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<HeaderEntries, A::Error> {
                let mut seen = HashSet::new();
                let mut entries = Vec::new();
                let mut duplicate = None;
                while let Some(key) = map.next_key::<String>()? {
                    let value = map.next_value::<serde_json::Value>()?;
                    if !seen.insert(key.clone()) {
                        duplicate.get_or_insert(key);
                    } else {
                        entries.push((key, value));
                    }
                }
                Ok(HeaderEntries { entries, duplicate })
            }
        }
        deserializer.deserialize_map(Entries)
    }
}

/// Reads exactly `buf.len()` bytes at `offset` (a positioned read: the file position is not
/// used, so threads share the handle). Unix only, as is the package (see the module docs).
fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

#[cfg(test)]
mod tests;
