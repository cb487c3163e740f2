//! One open, validated safetensors file and the reads of its tensors: whole, a byte range, or
//! strided spans (a column block), from a mapping or with positioned reads.

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use memmap2::{Mmap, MmapMut, MmapOptions, UncheckedAdvice};
use rayon::prelude::*;
use safetensors::tensor::{Metadata, TensorInfo};

use super::{open_regular_file, parse_header, read_exact_at, Backend};
use crate::error::{Error, Result};

/// The largest header the safetensors format allows, in bytes.
const MAX_HEADER_BYTES: u64 = 100_000_000;

enum Storage {
    /// The read-only mapping, the file handle (kept to check the file before each read), and
    /// the file's copy-on-write mapping for buffers handed out writable, made on first use.
    Mapped(Arc<Mmap>, File, OnceLock<Arc<MmapMut>>),
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

/// The bytes of one tensor for a receiver that may write them ([`SafetensorsFile::read_writable`]):
/// a range of the file's copy-on-write mapping, or an owned copy. Rust code never reads or
/// writes them after making the value: it forms no reference to them, only their address.
pub struct WritableData {
    /// What keeps the bytes alive.
    _owner: WritableOwner,
    address: usize,
    len: usize,
}

enum WritableOwner {
    /// The file's copy-on-write mapping (`MAP_PRIVATE`, `PROT_READ | PROT_WRITE`): a write
    /// copies the page into this process's memory; the file never changes.
    Cow { _map: Arc<MmapMut> },
    /// A copy read from the file.
    Owned { _bytes: Vec<u8> },
}

impl WritableData {
    fn cow(map: Arc<MmapMut>, range: Range<usize>) -> Self {
        // `as_ptr` borrows the mapping object, not its bytes; `range` lies inside the mapping
        // (checked by the caller), so the address stays in it.
        let address = map.as_ptr() as usize + range.start;
        Self {
            _owner: WritableOwner::Cow { _map: map },
            address,
            len: range.len(),
        }
    }

    fn owned(mut bytes: Vec<u8>) -> Self {
        let (address, len) = (bytes.as_mut_ptr() as usize, bytes.len());
        Self {
            _owner: WritableOwner::Owned { _bytes: bytes },
            address,
            len,
        }
    }

    /// The address of the first byte and the length in bytes: valid, and writable, while the
    /// value lives.
    pub fn address(&self) -> (usize, usize) {
        (self.address, self.len)
    }
}

/// One open, validated safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    /// Offset of the data section: 8 + header length.
    data_start: usize,
    metadata: Metadata,
    storage: Storage,
    /// What the file was when it was opened; every read compares the file with it.
    opened: Identity,
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
        // Taken before anything is read, so that a change during the open shows too.
        let opened = Identity::of(&file.metadata().map_err(io)?);
        let file_len = opened.size;
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
                Storage::Mapped(Arc::new(map), file, OnceLock::new())
            }
            Backend::Pread => Storage::File(file),
        };
        Ok(Self {
            path: path.to_path_buf(),
            data_start: 8 + header_len as usize,
            metadata,
            storage,
            opened,
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
            Storage::Mapped(map, _, _) => {
                Some(map.as_ptr() as usize..map.as_ptr() as usize + map.len())
            }
            Storage::File(_) => None,
        }
    }

    /// The open file and the absolute byte range in it of bytes `part` of tensor `name`
    /// (offsets within the tensor; `part.end` is clamped to the tensor's length), for copies the
    /// kernel does file to file (`copy_file_range`, `sendfile`) from the file this value opened,
    /// even if the path has since been replaced. `Ok(None)` for an unknown name or a `part` that
    /// starts past the tensor.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] when the file changed since it was opened (see [`Self::read`]);
    /// [`Error::Io`] when it cannot be examined.
    pub fn file_range(
        &self,
        name: &str,
        part: Range<usize>,
    ) -> Result<Option<(&File, Range<u64>)>> {
        let Some(info) = self.info(name) else {
            return Ok(None);
        };
        let (begin, end) = info.data_offsets;
        let part = part.start..part.end.min(end - begin);
        if part.start > part.end {
            return Ok(None);
        }
        self.check_unchanged(name, "copied")?;
        let start = (self.data_start + begin + part.start) as u64;
        Ok(Some((self.handle(), start..start + part.len() as u64)))
    }

    /// Drops this process's resident pages of tensor `name` from the mapping (the kernel's page
    /// cache keeps them), so a streaming pass over a large checkpoint does not grow the resident
    /// set. Arrays already viewing the tensor stay valid: their next access maps the pages again
    /// from the file, which has not changed. Only whole 64 KiB blocks inside the tensor are
    /// dropped; a no-op for `Pread` and for unknown names.
    pub fn release(&self, name: &str) {
        const BLOCK: usize = 64 << 10;
        let (Storage::Mapped(map, _, _), Some(info)) = (&self.storage, self.info(name)) else {
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
    /// The file is compared with what it was when it was opened (one `fstat`: size, mtime and
    /// ctime to the nanosecond, device and inode), so a file truncated or rewritten in place
    /// since then gives an error instead of bytes from its old offsets, a short read or, with
    /// `Mmap`, a SIGBUS: with `Mmap` before the range is handed out, with `Pread` after the
    /// bytes are read (so a change during the read shows too).
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::Checkpoint`] when the file changed since it was
    /// opened; [`Error::Io`] when a read fails otherwise.
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
        let info = self.tensor_info(name)?;
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
        match &self.storage {
            Storage::Mapped(map, _, _) => {
                self.check_unchanged(name, "read")?;
                Ok(TensorData::Mapped {
                    map: Arc::clone(map),
                    range,
                })
            }
            Storage::File(file) => {
                let mut bytes = self.zeroed(name, range.len())?;
                let read = read_exact_at(file, &mut bytes, range.start as u64);
                self.check_unchanged(name, "read")?;
                read.map_err(|source| self.read_failed(source))?;
                self.bytes_read
                    .fetch_add(range.len() as u64, Ordering::Relaxed);
                Ok(TensorData::Owned(bytes))
            }
        }
    }

    /// Bytes `part` of tensor `name` for a receiver that may write them: with `Mmap` a range
    /// of the file's copy-on-write mapping (`MAP_PRIVATE`, `PROT_READ | PROT_WRITE`, one per
    /// file, made on the first call: no byte is copied until a page is written, and a written
    /// page becomes this process's own; the file and the read-only mapping never see the
    /// write); with `Pread` a fresh copy, as [`Self::read_range`]. Every writable buffer of one
    /// file shares its copy-on-write mapping: two of the same bytes see each other's writes.
    ///
    /// # Errors
    /// As [`Self::read_range`]; [`Error::Io`] when the mapping cannot be made.
    pub fn read_writable(&self, name: &str, part: Range<usize>) -> Result<WritableData> {
        let data = self.read_range(name, part)?;
        let (Storage::Mapped(_, file, cow), TensorData::Mapped { range, .. }) =
            (&self.storage, &data)
        else {
            let TensorData::Owned(bytes) = data else {
                return Ok(WritableData::owned(data.as_slice().to_vec()));
            };
            return Ok(WritableData::owned(bytes));
        };
        let range = range.clone();
        let map = match cow.get() {
            Some(map) => Arc::clone(map),
            None => {
                // SAFETY: a private (copy-on-write) mapping: writes go to this process's own
                // pages, never to the file. A truncation by another process makes untouched
                // pages raise SIGBUS, as for the read-only mapping (see `open`); the file is
                // checked unchanged below, after the mapping is made.
                let map =
                    unsafe { MmapOptions::new().map_copy(file) }.map_err(|source| Error::Io {
                        path: self.path.clone(),
                        source,
                    })?;
                self.check_unchanged(name, "read")?;
                if map.len() < range.end {
                    return Err(Error::Checkpoint {
                        path: self.path.clone(),
                        reason: format!(
                            "tensor {name:?} cannot be read: the file is {} bytes now",
                            map.len()
                        ),
                    });
                }
                Arc::clone(cow.get_or_init(|| Arc::new(map)))
            }
        };
        Ok(WritableData::cow(map, range))
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
    /// included: no arguments panic or allocate more than the tensor), or when the file changed
    /// since it was opened (see [`Self::read`]); [`Error::Io`] when a read fails otherwise.
    pub fn read_spans(
        &self,
        name: &str,
        start: usize,
        span: usize,
        stride: usize,
        count: usize,
    ) -> Result<TensorData> {
        let info = self.tensor_info(name)?;
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
        let mut out = self.zeroed(name, total)?;
        match &self.storage {
            Storage::Mapped(map, _, _) => {
                self.check_unchanged(name, "read")?;
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
                self.check_unchanged(name, "read")?;
                done.map_err(|source| self.read_failed(source))?;
                self.bytes_read.fetch_add(total as u64, Ordering::Relaxed);
            }
        }
        Ok(TensorData::Owned(out))
    }

    /// The header entry of tensor `name`, or [`Error::TensorNotFound`].
    fn tensor_info(&self, name: &str) -> Result<&TensorInfo> {
        self.info(name).ok_or_else(|| Error::TensorNotFound {
            path: self.path.clone(),
            name: name.to_string(),
        })
    }

    /// The open file handle (both backends keep one).
    fn handle(&self) -> &File {
        match &self.storage {
            Storage::Mapped(_, file, _) | Storage::File(file) => file,
        }
    }

    /// Refuses to go on with tensor `name` (`what`: "read", "copied") when the file is no
    /// longer what it was when it was opened: one `fstat` of the open handle against
    /// [`Identity`]. A file replaced by rename passes: the handle (and the mapping) still reach
    /// the old file, whose bytes did not change.
    fn check_unchanged(&self, name: &str, what: &str) -> Result<()> {
        let metadata = self.handle().metadata().map_err(|source| Error::Io {
            path: self.path.clone(),
            source,
        })?;
        let now = Identity::of(&metadata);
        if !self.opened.differs(&now) || (self.opened.only_ctime_moved(&now) && self.replaced(&now))
        {
            return Ok(());
        }
        Err(Error::Checkpoint {
            path: self.path.clone(),
            reason: format!(
                "tensor {name:?} cannot be {what}: the file changed since it was opened ({}); \
                 reopen it (a file rewritten in place would be read at its old offsets)",
                self.opened.changes(&now)
            ),
        })
    }

    /// Whether the open file (`now`, its `fstat`) no longer has the path it was opened by: it
    /// was unlinked (no link left) or renamed over (the path names another file now). Only
    /// then is a ctime that moved alone excused: the unlink or the rename over the path moved
    /// it, and a writer reaches the file by its path. A ctime that moved while the path still
    /// names the open file (a hard link made, a chmod, a rewrite that put the old mtime back)
    /// cannot be told from a rewrite, and neither can one of a file that still has a link but
    /// not this path (moved elsewhere).
    fn replaced(&self, now: &Identity) -> bool {
        if now.nlink == 0 {
            return true;
        }
        // Followed, as the open was: a symbolic link into a blob store names its target.
        match std::fs::metadata(&self.path) {
            Ok(current) => {
                use std::os::unix::fs::MetadataExt;
                (current.dev(), current.ino()) != (now.dev, now.ino)
            }
            Err(_) => false,
        }
    }

    /// A zeroed buffer of `len` bytes to read tensor `name` into, or [`Error::Checkpoint`]
    /// naming the tensor and the size when the allocator cannot give it (`vec![0u8; len]`
    /// would abort the whole process, Python included, for a huge declared tensor).
    fn zeroed(&self, name: &str, len: usize) -> Result<Vec<u8>> {
        try_zeroed(len).ok_or_else(|| Error::Checkpoint {
            path: self.path.clone(),
            reason: format!(
                "tensor {name:?}: its {len} bytes cannot be allocated to read it with the pread \
                 backend (out of memory); read it with the mmap backend, or on a machine with \
                 that much free memory"
            ),
        })
    }

    fn read_failed(&self, source: std::io::Error) -> Error {
        Error::Io {
            path: self.path.clone(),
            source,
        }
    }
}

/// A zeroed `Vec<u8>` of `len` bytes, or `None` when the allocator has no such block.
///
/// As `vec![0u8; len]` does, this asks for zeroed memory (`calloc`: fresh pages from the kernel
/// are zero already, so no pass over them), but it returns `None` instead of aborting.
fn try_zeroed(len: usize) -> Option<Vec<u8>> {
    if len == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len).ok()?;
    // SAFETY: `layout` has a non-zero size (len > 0). `alloc_zeroed` returns null or a block
    // of `len` zeroed (so initialised) bytes aligned for u8, allocated by the global allocator
    // with exactly the layout `Vec<u8>` uses for capacity `len`: `from_raw_parts(ptr, len,
    // len)` takes ownership of it, and the Vec frees it with that same layout.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout);
        (!ptr.is_null()).then(|| Vec::from_raw_parts(ptr, len, len))
    }
}

/// What a file was when it was opened, as `fstat` gives it: compared before every read.
///
/// The device and inode cannot differ on the same open handle (they are recorded so that the
/// record is the file's whole identity). A rewrite in place changes the size, or the mtime and
/// the ctime (to the nanosecond; since Linux 6.13 a change right after an `fstat` always gets a
/// newer timestamp on ext4, XFS, btrfs and tmpfs); the ctime also catches a rewrite whose
/// writer then restored the old mtime. The ctime moves too when the file loses its path (an
/// unlink, a rename over it): a ctime that moved alone is excused only then, when the file has
/// no link left or its path names another file now (`SafetensorsFile::replaced`), so the usual
/// atomic replacement of a checkpoint stays readable through views opened before it. Anything
/// else that moves only the ctime while the path still names the open file (a chmod, a hard
/// link made, or made and removed again, a rename of the file itself) is refused: the view
/// cannot tell it from a rewrite that put the old mtime back (a link count that changed says
/// nothing of the bytes). On file systems with coarse timestamps, a rewrite to the same size
/// within one timestamp tick of the previous change can go unseen; so can a rewrite that put
/// the old mtime back made just before the file was unlinked or renamed over (that move
/// sets the ctime again).
#[derive(Debug, Clone, Copy)]
struct Identity {
    dev: u64,
    ino: u64,
    size: u64,
    /// Seconds and nanoseconds since the epoch.
    mtime: (i64, i64),
    ctime: (i64, i64),
    nlink: u64,
}

impl Identity {
    fn of(metadata: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            dev: metadata.dev(),
            ino: metadata.ino(),
            size: metadata.size(),
            mtime: (metadata.mtime(), metadata.mtime_nsec()),
            ctime: (metadata.ctime(), metadata.ctime_nsec()),
            nlink: metadata.nlink(),
        }
    }

    /// Whether the file `now` may hold other bytes than the file `self` described at open.
    fn differs(&self, now: &Self) -> bool {
        (self.dev, self.ino, self.size, self.mtime, self.ctime)
            != (now.dev, now.ino, now.size, now.mtime, now.ctime)
    }

    /// Whether only the ctime (and perhaps the link count) moved since `self`: what an unlink
    /// or a rename over the file's path does, and a rewrite that put the old mtime back too.
    fn only_ctime_moved(&self, now: &Self) -> bool {
        (self.dev, self.ino, self.size, self.mtime) == (now.dev, now.ino, now.size, now.mtime)
            && self.ctime != now.ctime
    }

    /// What differs between `self` (at open) and `now`, e.g. "size 100 -> 116 bytes, mtime
    /// 1767000000.000000001 -> 1767000005.250000000 (seconds since the epoch)".
    fn changes(&self, now: &Self) -> String {
        let time = |(s, ns): (i64, i64)| format!("{s}.{ns:09}");
        let mut parts = Vec::new();
        if (self.dev, self.ino) != (now.dev, now.ino) {
            parts.push(format!(
                "device {} inode {} -> device {} inode {}",
                self.dev, self.ino, now.dev, now.ino
            ));
        }
        if self.size != now.size {
            let shrunk = if now.size < self.size {
                " (truncated while open)"
            } else {
                ""
            };
            parts.push(format!("size {} -> {} bytes{shrunk}", self.size, now.size));
        }
        let times = [
            ("mtime", self.mtime, now.mtime),
            ("ctime", self.ctime, now.ctime),
        ];
        let mut timed = false;
        for (field, then, now) in times {
            if then != now {
                parts.push(format!("{field} {} -> {}", time(then), time(now)));
                timed = true;
            }
        }
        let mut changes = parts.join(", ");
        if timed {
            changes.push_str(" (seconds since the epoch)");
        }
        changes
    }
}

/// Below this many output bytes, `read_spans` reads on the calling thread.
const PARALLEL_SPAN_BYTES: usize = 4 << 20;
