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
//! A file that changes while it is open: its identity (size, mtime and ctime to the nanosecond,
//! device, inode) is recorded at open, before its header is read, and its length checked
//! against its header (and the mapping against that length). Every later read compares the
//! open handle's `fstat` with that record (one `fstat` per read call) and refuses a file that
//! changed, naming the file and what changed: a file truncated, or rewritten in place with a
//! longer header and the same tensors, is never read at its old offsets, on either backend
//! (with `Mmap` the check comes before the range is handed out, with `Pread` after the bytes are
//! read, so a change during the read shows too). What no check can catch: with `Mmap`, a tensor
//! already handed out still borrows the mapping, and touching its lost pages after a later
//! truncation raises SIGBUS (the kernel's rule for mappings), which no library can turn into an
//! error; `Pread` copies, so its bytes stay as they were read. A file replaced by rename (the
//! usual atomic rewrite) is safe on both backends: the open handle and mapping keep the old
//! contents, and the old file's identity does not change.
//!
//! Unix only (positioned reads with `FileExt::read_exact_at`), as is the package: its writer
//! locks output directories with `flock`.

mod directory;
mod file;
mod header;
mod index;

use std::fs::File;
use std::path::Path;

use crate::error::{Error, Result};

pub use directory::Checkpoint;
pub use file::{SafetensorsFile, TensorData, WritableData};
pub use header::parse_header;
pub use index::{parse_index, WeightMap, INDEX_NAME, MAX_INDEX_BYTES};

/// How tensor bytes are read from disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Map each file read-only and borrow from the mapping (zero copy).
    Mmap,
    /// Copy each tensor out with positioned reads; nothing is mapped.
    Pread,
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

/// Reads exactly `buf.len()` bytes at `offset` (a positioned read: the file position is not
/// used, so threads share the handle). Unix only, as is the package (see the module docs).
fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

#[cfg(test)]
mod tests;
