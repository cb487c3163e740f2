//! Tests of reading safetensors files and checkpoint directories: round trips on both backends,
//! and every refusal with its error variant. Files are written by hand (8-byte little-endian
//! header length, JSON header, data) into a fresh directory under the system temp dir.
//!
//! One module per concern: [`file`] (round trips of one file, and paths that are not regular
//! files), [`changed`] (files truncated, rewritten or replaced while open), [`refusals`]
//! (malformed files), [`directory`] (checkpoint directories and their index), [`header`]
//! (`parse_header` from memory), [`spans`] (`read_spans` and the read counter). The helpers
//! that write files are here.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use safetensors::Dtype;
use serde_json::json;

use super::*;

mod changed;
mod directory;
mod file;
mod header;
mod refusals;
mod spans;

/// A fresh directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("kda_tp-ckpt-{}-{tag}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let path = self.0.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::write(&path, bytes).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A safetensors file: header length (u64 LE), the header bytes, the data.
fn st_raw(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

fn st(header: &serde_json::Value, data: &[u8]) -> Vec<u8> {
    st_raw(header.to_string().as_bytes(), data)
}

/// A header for consecutive tensors `(name, dtype, shape)`, offsets derived from the sizes.
fn header_for(tensors: &[(&str, &str, &[usize])]) -> serde_json::Value {
    let mut map = serde_json::Map::new();
    let mut offset = 0;
    for (name, dtype, shape) in tensors {
        let elem = match *dtype {
            "F64" | "I64" => 8,
            "F32" | "I32" => 4,
            "BF16" | "F16" => 2,
            _ => 1,
        };
        let len = elem * shape.iter().product::<usize>();
        map.insert(
            name.to_string(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    serde_json::Value::Object(map)
}

/// Bytes 0, 1, 2, ... (mod 251), offset by `seed`.
fn data(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

/// One file with tensors `z` F32 [2, 3], `a` BF16 [4], `m` U8 [5] (in that data order) and a
/// `__metadata__` map.
fn three_tensor_file(dir: &TempDir, name: &str, seed: u8) -> (PathBuf, Vec<u8>) {
    let mut h = header_for(&[
        ("z", "F32", &[2, 3]),
        ("a", "BF16", &[4]),
        ("m", "U8", &[5]),
    ]);
    h["__metadata__"] = json!({"format": "pt", "origin": "kda_tp test"});
    let bytes = data(24 + 8 + 5, seed);
    (dir.write(name, &st(&h, &bytes)), bytes)
}

const BACKENDS: [Backend; 2] = [Backend::Mmap, Backend::Pread];

fn assert_contains(reason: &str, want: &str) {
    assert!(reason.contains(want), "{want:?} not in {reason:?}");
}

/// `a` U8 [8] at data bytes [0, 8) and `b` U8 [8] at [4, 12), overlapping it (12 data bytes).
fn overlapping_header() -> serde_json::Value {
    json!({
        "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]},
    })
}

/// `a` U8 [4] at data bytes [0, 4) and `b` U8 [4] at [8, 12): a gap of 4 bytes (12 data bytes).
fn gapped_header() -> serde_json::Value {
    json!({
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]},
    })
}

/// `a` U8 [4] at data bytes [4, 8): the data does not start at offset 0 (8 data bytes).
fn late_start_header() -> serde_json::Value {
    json!({"a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}})
}

/// `w` F32 [3] (12 bytes) whose offsets span 8 bytes.
fn size_mismatch_header() -> serde_json::Value {
    json!({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})
}
