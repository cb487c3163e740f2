//! A whole checkpoint: one safetensors file, a directory holding one, or a directory whose
//! index spreads the tensors over several files (each checked against the index).

use std::collections::BTreeMap;
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorInfo;

use super::{
    open_regular_file, parse_index, Backend, SafetensorsFile, TensorData, WeightMap, WritableData,
    INDEX_NAME, MAX_INDEX_BYTES,
};
use crate::error::{Error, Result};

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
        self.file_of(name)?
            .read_spans(name, start, span, stride, count)
    }

    /// Bytes `part` of tensor `name` (see [`SafetensorsFile::read_range`]).
    ///
    /// # Errors
    /// As [`SafetensorsFile::read_range`].
    pub fn read_range(&self, name: &str, part: Range<usize>) -> Result<TensorData> {
        self.file_of(name)?.read_range(name, part)
    }

    /// Bytes `part` of tensor `name`, writable by the receiver (see
    /// [`SafetensorsFile::read_writable`]).
    ///
    /// # Errors
    /// As [`SafetensorsFile::read_writable`].
    pub fn read_writable(&self, name: &str, part: Range<usize>) -> Result<WritableData> {
        self.file_of(name)?.read_writable(name, part)
    }

    /// The file holding tensor `name`, or [`Error::TensorNotFound`] naming the checkpoint.
    fn file_of(&self, name: &str) -> Result<&SafetensorsFile> {
        self.locate(name)
            .map(|(file, _)| file)
            .ok_or_else(|| Error::TensorNotFound {
                path: self.root.clone(),
                name: name.to_string(),
            })
    }
}
