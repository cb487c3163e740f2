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
//! network filesystems where page faults on a mapping are slow or unreliable. With `Mmap`, a file
//! truncated by another process after it was opened makes later reads of the lost pages raise
//! SIGBUS (the kernel's rule for mappings); do not rewrite checkpoints in place while they are open.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fs::File;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use memmap2::{Mmap, MmapOptions};
use safetensors::tensor::{Metadata, TensorInfo};
use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};

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
    Mapped(Arc<Mmap>),
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
        let file = File::open(path).map_err(io)?;
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
        if 8 + header_len > file_len {
            return Err(bad(format!(
                "header length {header_len} bytes runs past the end of the {file_len}-byte file"
            )));
        }
        // Both fit in usize: bounded by MAX_HEADER_BYTES.
        let mut header = vec![0u8; header_len as usize];
        read_exact_at(&file, &mut header, 8).map_err(io)?;
        let header =
            std::str::from_utf8(&header).map_err(|e| bad(format!("header is not UTF-8: {e}")))?;
        let TopLevelKeys(duplicate) = serde_json::from_str(header)
            .map_err(|e| bad(format!("header is not a JSON object: {e}")))?;
        if let Some(name) = duplicate {
            return Err(bad(format!("tensor {name:?} appears twice in the header")));
        }
        let metadata: Metadata =
            serde_json::from_str(header).map_err(|e| bad(format!("invalid header: {e}")))?;
        let described = 8 + header_len + metadata.data_len() as u64;
        if described != file_len {
            return Err(bad(format!(
                "the header describes {described} bytes but the file has {file_len} \
                 (truncated, or trailing bytes after the data)"
            )));
        }
        let storage = match backend {
            // SAFETY: a read-only private mapping. If another process truncates the file while
            // it is mapped, reads of the lost pages raise SIGBUS (documented above); the length
            // was checked against the header just now.
            Backend::Mmap => Storage::Mapped(Arc::new(
                unsafe { MmapOptions::new().map_copy_read_only(&file) }.map_err(io)?,
            )),
            Backend::Pread => Storage::File(file),
        };
        Ok(Self {
            path: path.to_path_buf(),
            data_start: 8 + header_len as usize,
            metadata,
            storage,
        })
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
            Storage::Mapped(map) => Some(map.as_ptr() as usize..map.as_ptr() as usize + map.len()),
            Storage::File(_) => None,
        }
    }

    /// The bytes of tensor `name`.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::Io`] when a positioned read fails.
    pub fn read(&self, name: &str) -> Result<TensorData> {
        let info = self.info(name).ok_or_else(|| Error::TensorNotFound {
            path: self.path.clone(),
            name: name.to_string(),
        })?;
        let (begin, end) = info.data_offsets;
        let range = self.data_start + begin..self.data_start + end;
        match &self.storage {
            Storage::Mapped(map) => Ok(TensorData::Mapped {
                map: Arc::clone(map),
                range,
            }),
            Storage::File(file) => {
                let mut bytes = vec![0u8; range.len()];
                read_exact_at(file, &mut bytes, range.start as u64).map_err(|source| {
                    Error::Io {
                        path: self.path.clone(),
                        source,
                    }
                })?;
                Ok(TensorData::Owned(bytes))
            }
        }
    }
}

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
        let text = std::fs::read(index_path).map_err(|source| Error::Io {
            path: index_path.to_path_buf(),
            source,
        })?;
        let json: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let weight_map = json
            .get("weight_map")
            .and_then(serde_json::Value::as_object)
            .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
        let canonical_root = root.canonicalize().map_err(|source| Error::Io {
            path: root.to_path_buf(),
            source,
        })?;

        let mut file_names: Vec<&str> = Vec::new();
        let mut wanted: BTreeMap<&str, &str> = BTreeMap::new();
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
            if !file_names.contains(&file) {
                file_names.push(file);
            }
            wanted.insert(tensor, file);
        }
        file_names.sort_unstable();

        let mut files = Vec::with_capacity(file_names.len());
        for file in &file_names {
            let full = root.join(file);
            let canonical = full.canonicalize().map_err(|source| Error::Io {
                path: full.clone(),
                source,
            })?;
            if !canonical.starts_with(&canonical_root) {
                return Err(bad(format!(
                    "{file:?} resolves to {}, outside the checkpoint directory",
                    canonical.display()
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
                        wanted.get(tensor.as_str()).copied().unwrap_or("no file")
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

    /// The bytes of tensor `name`.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::Io`] when a positioned read fails.
    pub fn read(&self, name: &str) -> Result<TensorData> {
        match self.locate(name) {
            Some((file, _)) => file.read(name),
            None => Err(Error::TensorNotFound {
                path: self.root.clone(),
                name: name.to_string(),
            }),
        }
    }
}

/// Parses a JSON object's keys only, remembering the first key seen twice.
struct TopLevelKeys(Option<String>);

impl<'de> Deserialize<'de> for TopLevelKeys {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Keys;
        impl<'de> Visitor<'de> for Keys {
            type Value = TopLevelKeys;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TopLevelKeys, A::Error> {
                let mut seen = HashSet::new();
                let mut duplicate = None;
                while let Some(key) = map.next_key::<String>()? {
                    map.next_value::<IgnoredAny>()?;
                    if !seen.insert(key.clone()) && duplicate.is_none() {
                        duplicate = Some(key);
                    }
                }
                Ok(TopLevelKeys(duplicate))
            }
        }
        deserializer.deserialize_map(Keys)
    }
}

#[cfg(unix)]
fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

#[cfg(windows)]
fn read_exact_at(file: &File, mut buf: &mut [u8], mut offset: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        match file.seek_read(buf, offset)? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
