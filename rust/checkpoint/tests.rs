//! Tests of reading safetensors files and checkpoint directories: round trips on both backends,
//! and every refusal with its error variant. Files are written by hand (8-byte little-endian
//! header length, JSON header, data) into a fresh directory under the system temp dir.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use safetensors::Dtype;
use serde_json::json;

use super::*;

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

// ---------------------------------------------------------------------------------------------
// One file.
// ---------------------------------------------------------------------------------------------

#[test]
fn a_file_round_trips_on_both_backends() {
    let dir = TempDir::new("roundtrip");
    let (path, bytes) = three_tensor_file(&dir, "m.safetensors", 0);
    for backend in BACKENDS {
        let f = SafetensorsFile::open(&path, backend).unwrap();
        assert_eq!(f.path(), path);
        assert_eq!(
            f.names(),
            ["z", "a", "m"],
            "data-offset order, not name order"
        );
        let z = f.info("z").unwrap();
        assert_eq!(
            (z.dtype, z.shape.as_slice(), z.data_offsets),
            (Dtype::F32, &[2usize, 3][..], (0, 24))
        );
        let a = f.info("a").unwrap();
        assert_eq!(
            (a.dtype, a.shape.as_slice(), a.data_offsets),
            (Dtype::BF16, &[4usize][..], (24, 32))
        );
        assert!(f.info("nope").is_none());
        assert_eq!(f.read("z").unwrap().as_slice(), &bytes[0..24]);
        assert_eq!(f.read("a").unwrap().as_slice(), &bytes[24..32]);
        assert_eq!(f.read("m").unwrap().as_slice(), &bytes[32..37]);
        let meta = f.user_metadata().unwrap();
        assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
        assert_eq!(meta.len(), 2);
    }
}

#[test]
fn mmap_borrows_from_the_mapping_and_pread_copies() {
    let dir = TempDir::new("zerocopy");
    let (path, _) = three_tensor_file(&dir, "m.safetensors", 5);
    let mapped = SafetensorsFile::open(&path, Backend::Mmap).unwrap();
    let copied = SafetensorsFile::open(&path, Backend::Pread).unwrap();
    let range = mapped.mapping().unwrap();
    assert_eq!(range.len() as u64, std::fs::metadata(&path).unwrap().len());
    assert_eq!(copied.mapping(), None);
    for name in mapped.names() {
        let m = mapped.read(&name).unwrap();
        let c = copied.read(&name).unwrap();
        assert!(matches!(m, TensorData::Mapped { .. }), "{name}");
        assert!(matches!(c, TensorData::Owned(_)), "{name}");
        let start = m.as_slice().as_ptr() as usize;
        assert!(
            range.contains(&start) && start + m.as_slice().len() <= range.end,
            "{name}"
        );
        assert_eq!(m.as_slice(), c.as_slice(), "{name}: mmap and pread agree");
    }
    // A TensorData keeps its mapping alive after the file is dropped.
    let z = mapped.read("z").unwrap();
    drop(mapped);
    assert_eq!(z.as_slice(), copied.read("z").unwrap().as_slice());
}

#[test]
fn mmap_and_pread_agree_on_a_larger_file() {
    let dir = TempDir::new("larger");
    let tensors: Vec<(String, &str, Vec<usize>)> = (0..20)
        .map(|i| {
            (
                format!("t{i:02}"),
                ["BF16", "F32", "U8", "F64"][i % 4],
                vec![i + 1, 1000 + 7 * i],
            )
        })
        .collect();
    let spec: Vec<(&str, &str, &[usize])> = tensors
        .iter()
        .map(|(n, d, s)| (n.as_str(), *d, s.as_slice()))
        .collect();
    let h = header_for(&spec);
    let total = h
        .as_object()
        .unwrap()
        .values()
        .map(|v| v["data_offsets"][1].as_u64().unwrap())
        .max()
        .unwrap();
    let bytes: Vec<u8> = (0..total as usize)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let path = dir.write("big.safetensors", &st(&h, &bytes));
    let m = SafetensorsFile::open(&path, Backend::Mmap).unwrap();
    let p = SafetensorsFile::open(&path, Backend::Pread).unwrap();
    assert_eq!(m.names().len(), 20);
    for name in m.names() {
        let (b, e) = m.info(&name).unwrap().data_offsets;
        assert_eq!(m.read(&name).unwrap().as_slice(), &bytes[b..e], "{name}");
        assert_eq!(p.read(&name).unwrap().as_slice(), &bytes[b..e], "{name}");
    }
}

#[test]
fn reading_a_missing_tensor() {
    let dir = TempDir::new("missing-tensor");
    let (path, _) = three_tensor_file(&dir, "m.safetensors", 0);
    for backend in BACKENDS {
        match SafetensorsFile::open(&path, backend)
            .unwrap()
            .read("q_proj")
        {
            Err(Error::TensorNotFound { path: p, name }) => {
                assert_eq!((p, name.as_str()), (path.clone(), "q_proj"))
            }
            Err(e) => panic!("{e:?}"),
            Ok(_) => panic!("read a tensor that is not there"),
        }
    }
}

#[test]
fn an_empty_header_and_a_space_padded_header_are_valid() {
    let dir = TempDir::new("empty-header");
    let path = dir.write("empty.safetensors", &st_raw(b"{}", b""));
    for backend in BACKENDS {
        let f = SafetensorsFile::open(&path, backend).unwrap();
        assert!(f.names().is_empty());
        assert!(f.user_metadata().is_none());
    }
    // The safetensors writer pads the header with spaces to a multiple of 8.
    let h = header_for(&[("x", "F32", &[2])]).to_string();
    let padded = format!("{h:<width$}", width = h.len().next_multiple_of(8) + 8);
    let path = dir.write(
        "padded.safetensors",
        &st_raw(padded.as_bytes(), &[1, 2, 3, 4, 5, 6, 7, 8]),
    );
    for backend in BACKENDS {
        let f = SafetensorsFile::open(&path, backend).unwrap();
        assert_eq!(f.read("x").unwrap().as_slice(), &[1, 2, 3, 4, 5, 6, 7, 8]);
    }
}

/// A header length that leaves the data section unaligned for F32 still reads the right bytes
/// (nothing here reinterprets them in place).
#[test]
fn a_misaligned_data_offset_reads_the_right_bytes() {
    let dir = TempDir::new("misaligned");
    let h = header_for(&[("w", "F32", &[3])]).to_string();
    // Pad with spaces so that the data section starts 2 bytes past a multiple of 4.
    let pad = (0..4).find(|p| (8 + h.len() + p) % 4 == 2).unwrap();
    let header = format!("{h:<width$}", width = h.len() + pad);
    assert_ne!(
        (8 + header.len()) % 4,
        0,
        "the data section must start unaligned"
    );
    let values = [1.5f32, -2.0, 3.25];
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let path = dir.write("m.safetensors", &st_raw(header.as_bytes(), &bytes));
    for backend in BACKENDS {
        let f = SafetensorsFile::open(&path, backend).unwrap();
        let got = f.read("w").unwrap();
        assert_eq!(got.as_slice(), &bytes[..], "{backend:?}");
        let decoded: Vec<f32> = got
            .as_slice()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(decoded, values);
    }
}

// ---------------------------------------------------------------------------------------------
// Refusals of one file.
// ---------------------------------------------------------------------------------------------

/// Writes `bytes`, opens them on both backends (as a file and as a checkpoint), expects
/// `Error::Safetensors` naming the file, and returns the reason.
fn refused(bytes: &[u8]) -> String {
    let dir = TempDir::new("refused");
    let path = dir.write("bad.safetensors", bytes);
    let mut reasons = Vec::new();
    for backend in BACKENDS {
        for r in [
            SafetensorsFile::open(&path, backend).map(|_| ()),
            Checkpoint::open(&path, backend).map(|_| ()),
            Checkpoint::open(dir.path(), backend).map(|_| ()),
        ] {
            match r {
                Err(Error::Safetensors { path: p, reason }) => {
                    assert_eq!(p, path);
                    reasons.push(reason);
                }
                other => panic!("expected Error::Safetensors, got {other:?}"),
            }
        }
    }
    assert!(reasons.windows(2).all(|w| w[0] == w[1]), "{reasons:?}");
    reasons.swap_remove(0)
}

fn assert_contains(reason: &str, want: &str) {
    assert!(reason.contains(want), "{want:?} not in {reason:?}");
}

#[test]
fn refuses_an_empty_file() {
    assert_contains(
        &refused(b""),
        "the file is 0 bytes, shorter than the 8-byte header length",
    );
}

#[test]
fn refuses_a_file_shorter_than_8_bytes() {
    assert_contains(&refused(&[2, 0, 0, 0, 0, 0, 0]), "the file is 7 bytes");
    assert_contains(&refused(&[0]), "the file is 1 bytes");
}

#[test]
fn refuses_a_header_length_past_the_end() {
    let mut bytes = 100u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    assert_contains(
        &refused(&bytes),
        "header length 100 bytes runs past the end of the 10-byte file",
    );
    // One byte short.
    let mut bytes = 3u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    assert_contains(&refused(&bytes), "runs past the end");
}

#[test]
fn refuses_a_huge_header_length() {
    for len in [1u64 << 63, u64::MAX, 100_000_001] {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        assert_contains(
            &refused(&bytes),
            &format!("header length {len} bytes exceeds"),
        );
    }
}

#[test]
fn refuses_a_non_utf8_header() {
    assert_contains(
        &refused(&st_raw(&[b'{', 0xFF, 0xFE, b'}'], b"")),
        "header is not UTF-8",
    );
}

#[test]
fn refuses_a_header_that_is_not_a_json_object() {
    for header in [
        &b"hello"[..],
        b"[]",
        b"[{\"a\": 1}]",
        b"42",
        b"\"x\"",
        b"null",
        b"{\"a\":",
        b"{} x",
        b"",
    ] {
        assert_contains(
            &refused(&st_raw(header, b"")),
            "header is not a JSON object",
        );
    }
}

#[test]
fn refuses_an_unknown_dtype() {
    let h = json!({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}});
    assert_contains(&refused(&st(&h, &[0, 0])), "invalid header");
}

#[test]
fn refuses_a_byte_range_that_disagrees_with_the_shape() {
    // F32 [3] is 12 bytes, the offsets say 8.
    let h = json!({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}});
    assert_contains(&refused(&st(&h, &[0; 8])), "invalid header");
    // Missing fields.
    let h = json!({"w": {"dtype": "F32", "shape": [2]}});
    assert_contains(&refused(&st(&h, &[0; 8])), "invalid header");
    // A shape whose byte size overflows.
    let h = json!({"w": {"dtype": "F32", "shape": [u64::MAX, 4], "data_offsets": [0, 8]}});
    assert_contains(&refused(&st(&h, &[0; 8])), "invalid header");
}

#[test]
fn refuses_overlapping_tensors() {
    let h = json!({
        "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]},
    });
    assert_contains(&refused(&st(&h, &[0; 12])), "invalid header");
}

#[test]
fn refuses_a_gap_between_tensors() {
    let h = json!({
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]},
    });
    assert_contains(&refused(&st(&h, &[0; 12])), "invalid header");
    // Data that does not start at offset 0.
    let h = json!({"a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}});
    assert_contains(&refused(&st(&h, &[0; 8])), "invalid header");
}

#[test]
fn refuses_offsets_past_the_end_of_the_file() {
    let h = header_for(&[("a", "F32", &[2]), ("b", "U8", &[4])]);
    let header_len = h.to_string().len() as u64;
    let reason = refused(&st(&h, &[0; 8]));
    assert_contains(
        &reason,
        &format!(
            "the header describes {} bytes but the file has {}",
            8 + header_len + 12,
            8 + header_len + 8
        ),
    );
    assert_contains(&reason, "truncated");
}

#[test]
fn refuses_trailing_bytes() {
    let h = header_for(&[("a", "F32", &[2])]);
    let header_len = h.to_string().len() as u64;
    let reason = refused(&st(&h, &[0; 9]));
    assert_contains(
        &reason,
        &format!(
            "describes {} bytes but the file has {}",
            8 + header_len + 8,
            8 + header_len + 9
        ),
    );
    // An empty header followed by data.
    assert_contains(
        &refused(&st_raw(b"{}", &[0])),
        "describes 10 bytes but the file has 11",
    );
}

#[test]
fn refuses_duplicate_tensor_names() {
    // serde_json keeps the last of two equal keys; the file must be refused instead.
    let header = br#"{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
    assert_contains(
        &refused(&st_raw(header, &[0; 4])),
        "tensor \"w\" appears twice in the header",
    );
    let header = br#"{"__metadata__":{},"__metadata__":{},"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
    assert_contains(
        &refused(&st_raw(header, &[0])),
        "\"__metadata__\" appears twice",
    );
}

/// The reference reader (`safetensors` itself) opens `"__metadata__": null` as no metadata.
#[test]
fn a_null_metadata_is_no_metadata() {
    let dir = TempDir::new("null-metadata");
    let header = br#"{"__metadata__":null,"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#;
    let path = dir.write("null.safetensors", &st_raw(header, &[7, 9]));
    for backend in BACKENDS {
        let f = SafetensorsFile::open(&path, backend).unwrap();
        assert!(f.user_metadata().is_none());
        assert_eq!(f.names(), ["w"]);
        assert_eq!(f.read("w").unwrap().as_slice(), &[7, 9]);
    }
}

/// F4 and F6 tensors are sized by bits: a whole number of bytes opens and reads back.
#[test]
fn sub_byte_dtypes_are_sized_by_bits() {
    let dir = TempDir::new("sub-byte");
    let h = json!({
        "f4": {"dtype": "F4", "shape": [4, 6], "data_offsets": [0, 12]},
        "f6a": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [12, 15]},
        "f6b": {"dtype": "F6_E3M2", "shape": [2, 4], "data_offsets": [15, 21]},
        "e8m0": {"dtype": "F8_E8M0", "shape": [3], "data_offsets": [21, 24]},
    });
    let bytes = data(24, 5);
    let path = dir.write("sub.safetensors", &st(&h, &bytes));
    for backend in BACKENDS {
        let f = SafetensorsFile::open(&path, backend).unwrap();
        for (name, range) in [
            ("f4", 0..12),
            ("f6a", 12..15),
            ("f6b", 15..21),
            ("e8m0", 21..24),
        ] {
            assert_eq!(
                f.read(name).unwrap().as_slice(),
                &bytes[range],
                "{name} {backend:?}"
            );
        }
    }
}

#[test]
fn refuses_a_non_string_metadata_value() {
    let h = json!({"__metadata__": {"n": 3}});
    assert_contains(&refused(&st(&h, b"")), "invalid header");
}

#[test]
fn a_missing_file_is_an_io_error() {
    let dir = TempDir::new("nofile");
    let path = dir.path().join("absent.safetensors");
    for backend in BACKENDS {
        for r in [
            SafetensorsFile::open(&path, backend).map(|_| ()),
            Checkpoint::open(&path, backend).map(|_| ()),
        ] {
            match r {
                Err(Error::Io { path: p, source }) => {
                    assert_eq!(p, path);
                    assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
                }
                other => panic!("{other:?}"),
            }
        }
    }
}

#[test]
fn error_display_names_the_file() {
    let dir = TempDir::new("display");
    let path = dir.write("bad.safetensors", b"abc");
    let e = SafetensorsFile::open(&path, Backend::Pread).err().unwrap();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: invalid safetensors file: the file is 3 bytes, shorter than the 8-byte header length",
            path.display()
        )
    );
}

// ---------------------------------------------------------------------------------------------
// Checkpoints: a single file, a directory with one file, a directory with an index.
// ---------------------------------------------------------------------------------------------

#[test]
fn a_single_file_checkpoint() {
    let dir = TempDir::new("single");
    let (path, bytes) = three_tensor_file(&dir, "model.safetensors", 9);
    for backend in BACKENDS {
        for ckpt in [
            Checkpoint::open(&path, backend).unwrap(),
            Checkpoint::open(dir.path(), backend).unwrap(),
        ] {
            assert_eq!(ckpt.root(), dir.path());
            assert_eq!(ckpt.files().len(), 1);
            assert_eq!(ckpt.names(), ["z", "a", "m"]);
            assert_eq!(ckpt.read("a").unwrap().as_slice(), &bytes[24..32]);
            let (file, info) = ckpt.locate("m").unwrap();
            assert_eq!(file.path(), path);
            assert_eq!(info.data_offsets, (32, 37));
            assert!(ckpt.locate("q").is_none());
            match ckpt.read("q") {
                Err(Error::TensorNotFound { path: p, name }) => {
                    assert_eq!((p.as_path(), name.as_str()), (dir.path(), "q"));
                }
                Err(e) => panic!("{e:?}"),
                Ok(_) => panic!("read a tensor that is not there"),
            }
        }
    }
}

#[test]
fn a_directory_without_index_ignores_hidden_and_other_files() {
    let dir = TempDir::new("one-of-many");
    let (path, _) = three_tensor_file(&dir, "weights.safetensors", 1);
    dir.write("config.json", b"{}");
    dir.write(".hidden.safetensors", b"not a safetensors file");
    dir.write("weights.safetensors.bak", b"junk");
    for backend in BACKENDS {
        let ckpt = Checkpoint::open(dir.path(), backend).unwrap();
        assert_eq!(ckpt.files().len(), 1);
        assert_eq!(ckpt.files()[0].path(), path);
    }
}

fn checkpoint_err(path: &Path) -> (PathBuf, String) {
    let mut seen = Vec::new();
    for backend in BACKENDS {
        match Checkpoint::open(path, backend) {
            Err(Error::Checkpoint { path, reason }) => seen.push((path, reason)),
            Err(e) => panic!("expected Error::Checkpoint, got {e:?}"),
            Ok(_) => panic!("expected Error::Checkpoint, got a checkpoint"),
        }
    }
    assert_eq!(seen[0], seen[1]);
    seen.swap_remove(0)
}

#[test]
fn a_directory_without_safetensors_files() {
    let dir = TempDir::new("none");
    dir.write("config.json", b"{}");
    dir.write(".hidden.safetensors", &st_raw(b"{}", b""));
    let (path, reason) = checkpoint_err(dir.path());
    assert_eq!(path, dir.path());
    assert_contains(&reason, "no .safetensors file in the directory");
}

#[test]
fn a_directory_with_two_files_and_no_index() {
    let dir = TempDir::new("two");
    three_tensor_file(&dir, "a.safetensors", 0);
    dir.write(
        "b.safetensors",
        &st(&header_for(&[("other", "U8", &[2])]), &[1, 2]),
    );
    let (path, reason) = checkpoint_err(dir.path());
    assert_eq!(path, dir.path());
    assert_contains(
        &reason,
        "2 .safetensors files and no model.safetensors.index.json",
    );
}

const F1: &str = "model-00001-of-00002.safetensors";
const F2: &str = "model-00002-of-00002.safetensors";

/// Two shard files: F1 holds `a` (BF16 [3]) and `b` (F32 [2]), F2 holds `c` (U8 [5]).
fn two_shards(dir: &TempDir) -> (Vec<u8>, Vec<u8>) {
    let d1 = data(6 + 8, 3);
    let d2 = data(5, 4);
    dir.write(
        F1,
        &st(&header_for(&[("a", "BF16", &[3]), ("b", "F32", &[2])]), &d1),
    );
    dir.write(F2, &st(&header_for(&[("c", "U8", &[5])]), &d2));
    (d1, d2)
}

fn write_index(dir: &TempDir, weight_map: serde_json::Value) -> PathBuf {
    let index = json!({"metadata": {"total_size": 19}, "weight_map": weight_map});
    dir.write(INDEX_NAME, index.to_string().as_bytes())
}

#[test]
fn a_directory_with_an_index_round_trips() {
    let dir = TempDir::new("index");
    let (d1, d2) = two_shards(&dir);
    write_index(&dir, json!({"c": F2, "a": F1, "b": F1}));
    dir.write("config.json", b"{}");
    for backend in BACKENDS {
        let ckpt = Checkpoint::open(dir.path(), backend).unwrap();
        assert_eq!(ckpt.root(), dir.path());
        let files: Vec<&Path> = ckpt.files().iter().map(SafetensorsFile::path).collect();
        assert_eq!(files, [dir.path().join(F1), dir.path().join(F2)]);
        assert_eq!(ckpt.names(), ["a", "b", "c"]);
        assert_eq!(ckpt.read("a").unwrap().as_slice(), &d1[0..6]);
        assert_eq!(ckpt.read("b").unwrap().as_slice(), &d1[6..14]);
        assert_eq!(ckpt.read("c").unwrap().as_slice(), &d2[..]);
        assert_eq!(ckpt.locate("c").unwrap().0.path(), dir.path().join(F2));
        assert_eq!(ckpt.locate("c").unwrap().1.dtype, Dtype::U8);
        assert!(matches!(ckpt.read("d"), Err(Error::TensorNotFound { .. })));
    }
}

#[test]
fn an_index_may_name_files_in_a_subdirectory() {
    let dir = TempDir::new("index-subdir");
    let bytes = data(4, 0);
    dir.write(
        "shards/x.safetensors",
        &st(&header_for(&[("x", "F32", &[1])]), &bytes),
    );
    write_index(&dir, json!({"x": "shards/x.safetensors"}));
    let ckpt = Checkpoint::open(dir.path(), Backend::Mmap).unwrap();
    assert_eq!(ckpt.read("x").unwrap().as_slice(), &bytes[..]);
}

fn index_err(dir: &TempDir) -> String {
    let (path, reason) = checkpoint_err(dir.path());
    assert_eq!(path, dir.path().join(INDEX_NAME));
    reason
}

#[test]
fn refuses_an_index_that_is_not_json() {
    let dir = TempDir::new("index-notjson");
    two_shards(&dir);
    dir.write(INDEX_NAME, b"{\"weight_map\": ");
    assert_contains(&index_err(&dir), "not JSON");
}

#[test]
fn refuses_an_index_without_a_weight_map() {
    let dir = TempDir::new("index-nomap");
    two_shards(&dir);
    dir.write(INDEX_NAME, br#"{"metadata": {}}"#);
    assert_contains(&index_err(&dir), "no \"weight_map\" object");
    dir.write(INDEX_NAME, br#"{"weight_map": ["a"]}"#);
    assert_contains(&index_err(&dir), "no \"weight_map\" object");
    dir.write(INDEX_NAME, b"[]");
    assert_contains(&index_err(&dir), "no \"weight_map\" object");
}

#[test]
fn refuses_a_weight_map_entry_that_is_not_a_string() {
    let dir = TempDir::new("index-nonstring");
    two_shards(&dir);
    write_index(&dir, json!({"a": F1, "b": F1, "c": 2}));
    assert_contains(&index_err(&dir), "weight_map[\"c\"] is not a file name");
}

#[test]
fn refuses_an_index_naming_a_missing_file() {
    let dir = TempDir::new("index-missing");
    two_shards(&dir);
    write_index(
        &dir,
        json!({"a": F1, "b": F1, "c": "model-00003-of-00002.safetensors"}),
    );
    // The error names the index, the file and a tensor mapped to it.
    let reason = index_err(&dir);
    assert_contains(
        &reason,
        "weight_map[\"c\"] = \"model-00003-of-00002.safetensors\", which does not exist",
    );
}

#[test]
fn refuses_a_tensor_mapped_to_a_file_that_lacks_it() {
    let dir = TempDir::new("index-lacks");
    two_shards(&dir);
    write_index(&dir, json!({"a": F1, "b": F1, "c": F1}));
    let reason = index_err(&dir);
    assert_contains(
        &reason,
        &format!("maps tensor \"c\" to {F1}, which has no such tensor"),
    );
}

#[test]
fn refuses_paths_that_leave_the_directory() {
    let dir = TempDir::new("index-escape");
    two_shards(&dir);
    let outside =
        std::env::temp_dir().join(format!("kda_tp-outside-{}.safetensors", std::process::id()));
    for bad in [
        "../outside.safetensors".to_string(),
        format!("shards/../../{F2}"),
        outside.display().to_string(),
        "/etc/passwd".to_string(),
        String::new(),
        format!("./{F2}"),
    ] {
        write_index(&dir, json!({"a": F1, "b": F1, "c": bad}));
        let reason = index_err(&dir);
        assert_contains(
            &reason,
            &format!("weight_map[\"c\"] = {bad:?} is not a plain relative path"),
        );
    }
}

#[cfg(unix)]
#[test]
fn a_symlink_into_a_blob_store_is_followed() {
    // The Hugging Face cache: snapshots/<rev>/<file> -> ../../blobs/<sha>.
    let dir = TempDir::new("index-symlink");
    let outside = TempDir::new("index-symlink-target");
    two_shards(&dir);
    let bytes = data(5, 0);
    let target = outside.write(
        "c.safetensors",
        &st(&header_for(&[("c", "U8", &[5])]), &bytes),
    );
    std::os::unix::fs::symlink(&target, dir.path().join("link.safetensors")).unwrap();
    write_index(&dir, json!({"a": F1, "b": F1, "c": "link.safetensors"}));
    let ckpt = Checkpoint::open(dir.path(), Backend::Mmap).unwrap();
    assert_eq!(ckpt.read("c").unwrap().as_slice(), &bytes[..]);
}

#[cfg(unix)]
#[test]
fn a_symlink_inside_the_directory_is_followed() {
    let dir = TempDir::new("index-symlink-inside");
    let (_, d2) = two_shards(&dir);
    std::os::unix::fs::symlink(dir.path().join(F2), dir.path().join("alias.safetensors")).unwrap();
    write_index(&dir, json!({"a": F1, "b": F1, "c": "alias.safetensors"}));
    let ckpt = Checkpoint::open(dir.path(), Backend::Pread).unwrap();
    assert_eq!(ckpt.read("c").unwrap().as_slice(), &d2[..]);
}

#[test]
fn refuses_a_file_tensor_missing_from_the_index() {
    let dir = TempDir::new("index-unlisted");
    two_shards(&dir);
    write_index(&dir, json!({"a": F1, "c": F2}));
    assert_contains(
        &index_err(&dir),
        &format!("{F1} holds tensor \"b\", which the index maps to no file"),
    );
}

#[test]
fn refuses_a_tensor_held_by_two_files() {
    let dir = TempDir::new("index-twice");
    two_shards(&dir);
    // F2 also holds `a`; the index says `a` lives in F1.
    dir.write(
        F2,
        &st(
            &header_for(&[("c", "U8", &[5]), ("a", "BF16", &[3])]),
            &data(11, 0),
        ),
    );
    write_index(&dir, json!({"a": F1, "b": F1, "c": F2}));
    assert_contains(
        &index_err(&dir),
        &format!("{F2} holds tensor \"a\", which the index maps to {F1}"),
    );
}

#[test]
fn a_bad_shard_file_is_refused_through_the_index() {
    let dir = TempDir::new("index-badshard");
    two_shards(&dir);
    dir.write(F2, b"tiny");
    write_index(&dir, json!({"a": F1, "b": F1, "c": F2}));
    for backend in BACKENDS {
        match Checkpoint::open(dir.path(), backend) {
            Err(Error::Safetensors { path, reason }) => {
                assert_eq!(path, dir.path().join(F2));
                assert_contains(&reason, "the file is 4 bytes");
            }
            Err(e) => panic!("{e:?}"),
            Ok(_) => panic!("opened a checkpoint with a corrupt shard"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Named refusals from `parse_header` (no file I/O), files that change while open, and files
// that are not regular files.
// ---------------------------------------------------------------------------------------------

fn header_err(header: &[u8], data_len: u64) -> String {
    match parse_header(Path::new("mem.safetensors"), header, data_len) {
        Err(Error::Safetensors { path, reason }) => {
            assert_eq!(path, Path::new("mem.safetensors"));
            reason
        }
        Err(e) => panic!("expected Error::Safetensors, got {e:?}"),
        Ok(_) => panic!("accepted {:?}", String::from_utf8_lossy(header)),
    }
}

#[test]
fn parse_header_names_the_tensor() {
    let h = json!({"ok": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                   "odd": {"dtype": "Q7", "shape": [2], "data_offsets": [1, 3]}});
    assert_contains(
        &header_err(h.to_string().as_bytes(), 3),
        "tensor \"odd\": unknown variant",
    );
    let h = json!({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}});
    assert_contains(
        &header_err(h.to_string().as_bytes(), 8),
        "tensor \"w\": shape [3] of F32 is 12 bytes, but its data_offsets [0, 8] span 8 bytes",
    );
    let h = json!({"w": {"dtype": "U8", "shape": [0], "data_offsets": [8, 0]}});
    assert_contains(
        &header_err(h.to_string().as_bytes(), 8),
        "end before they begin",
    );
    let h = json!({"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}});
    assert_contains(
        &header_err(h.to_string().as_bytes(), 2),
        "not a whole number of bytes",
    );
    let h =
        json!({"w": {"dtype": "F32", "shape": [1u64 << 40, 1u64 << 40], "data_offsets": [0, 8]}});
    assert_contains(
        &header_err(h.to_string().as_bytes(), 8),
        "tensor \"w\": shape",
    );
    let h = json!({
        "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]},
    });
    assert_contains(
        &header_err(h.to_string().as_bytes(), 12),
        "tensor \"b\" (data bytes [4, 12)) overlaps tensor \"a\"",
    );
    let h = json!({
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]},
    });
    assert_contains(
        &header_err(h.to_string().as_bytes(), 12),
        "a gap of 4 bytes between tensor \"a\"",
    );
    let h = json!({"a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}});
    assert_contains(
        &header_err(h.to_string().as_bytes(), 8),
        "between the start of the data section",
    );
    let h = header_for(&[("a", "F32", &[2]), ("b", "U8", &[4])]);
    assert_contains(
        &header_err(h.to_string().as_bytes(), 10),
        "tensor \"b\" ends at data byte 12, past the 10 data bytes",
    );
    assert_contains(
        &header_err(h.to_string().as_bytes(), 13),
        "(1 trailing bytes after the data)",
    );
}

/// The fast path of header parsing (typed, one pass) gives what the slow path (JSON values)
/// gives, and gives up (`None`) where the slow path must word a refusal.
#[test]
fn typed_entries_agree_with_value_entries() {
    let flat = |(meta, tensors): ParsedHeader| {
        let mut meta: Vec<_> = meta.map(|m| m.into_iter().collect()).unwrap_or_default();
        meta.sort();
        let tensors: Vec<_> = tensors
            .into_iter()
            .map(|(n, i)| (n, i.dtype, i.shape, i.data_offsets))
            .collect();
        (meta, tensors)
    };
    for text in [
        "{}",
        "  {}  ",
        r#"{"__metadata__": null}"#,
        r#"{"__metadata__": {"format": "pt", "k": "v"}, "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}"#,
        r#"{"z": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0], "extra": [1, {"x": 2}]}}"#,
        // A field twice inside an entry: serde_json's values keep the last, the typed path
        // gives up, and the slow path accepts it as before.
        r#"{"w": {"dtype": "U8", "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}"#,
    ] {
        let slow = flat(value_entries(Path::new("p"), text).unwrap());
        if let Some(fast) = typed_entries(text) {
            assert_eq!(flat(fast), slow, "{text}");
        }
    }
    for text in [
        r#"{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}"#,
        r#"{"__metadata__": null, "__metadata__": {}}"#,
        r#"{"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}"#,
        r#"{"__metadata__": {"k": 1}}"#,
        "{} x",
        "[]",
    ] {
        assert!(typed_entries(text).is_none(), "{text}");
        assert!(value_entries(Path::new("p"), text).is_err(), "{text}");
    }
}

#[test]
fn parse_header_does_not_overflow_on_huge_offsets() {
    // One U8 tensor whose end offset is as large as the bit count allows: the described length
    // (8 + header + data) must not wrap around.
    for n in [u64::MAX / 8, (1u64 << 61) - 3, 1u64 << 60] {
        let h = json!({"big": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}});
        assert_contains(
            &header_err(h.to_string().as_bytes(), 16),
            "tensor \"big\" ends at",
        );
    }
    // Zero-length tensors at one offset are fine, in a deterministic order.
    let h = json!({
        "z2": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
        "z1": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]},
        "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
    });
    let m = parse_header(Path::new("m"), h.to_string().as_bytes(), 2).unwrap();
    assert_eq!(m.offset_keys(), ["z1", "z2", "a"]);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
    /// One validator: the safetensors crate decides what is valid, and every refusal it makes
    /// is worded with the tensor at fault (never its bare message). The header is accepted
    /// exactly when the tensors, in data order, run back to back from byte 0, each the size
    /// its dtype and shape give, together `data_len` bytes.
    #[test]
    fn parse_header_accepts_what_the_crate_accepts_and_names_each_refusal(
        entries in proptest::collection::vec(
            (0usize..3, 0usize..6, 0usize..3, 0usize..20, 0usize..20),
            0..4,
        ),
        data_len in 0u64..40,
    ) {
        let dtypes = ["U8", "F32", "F4"];
        let mut header = serde_json::Map::new();
        let mut spans = Vec::new();
        for (i, &(dtype, dim, dims, begin, len)) in entries.iter().enumerate() {
            let shape = vec![dim; dims];
            // Mostly consistent, sometimes reversed offsets.
            let end = if i % 3 == 2 { begin.saturating_sub(len) } else { begin + len };
            let bits = shape.iter().product::<usize>() * [8, 32, 4][dtype];
            spans.push((begin, end, bits));
            header.insert(
                format!("t{i}"),
                json!({"dtype": dtypes[dtype], "shape": shape, "data_offsets": [begin, end]}),
            );
        }
        spans.sort_unstable();
        let mut at = 0;
        let mut valid = true;
        for &(begin, end, bits) in &spans {
            valid &= begin == at && end >= begin && bits % 8 == 0 && bits / 8 == end - begin;
            at = end;
        }
        valid &= at as u64 == data_len;
        let text = serde_json::Value::Object(header).to_string();
        match parse_header(Path::new("p"), text.as_bytes(), data_len) {
            Ok(_) => proptest::prop_assert!(valid, "accepted {text}"),
            Err(Error::Safetensors { reason, .. }) => {
                proptest::prop_assert!(!valid, "refused {text}: {reason}");
                proptest::prop_assert!(
                    reason.contains("tensor \"") || reason.contains("trailing bytes"),
                    "{reason}"
                );
            }
            Err(e) => proptest::prop_assert!(false, "{e:?}"),
        }
    }
}

#[test]
fn a_file_truncated_after_open_is_an_error_on_both_backends() {
    let dir = TempDir::new("truncated-later");
    let (path, bytes) = three_tensor_file(&dir, "m.safetensors", 1);
    for backend in BACKENDS {
        std::fs::write(
            &path,
            st(
                &header_for(&[
                    ("z", "F32", &[2, 3]),
                    ("a", "BF16", &[4]),
                    ("m", "U8", &[5]),
                ]),
                &bytes,
            ),
        )
        .unwrap();
        let f = SafetensorsFile::open(&path, backend).unwrap();
        let len = std::fs::metadata(&path).unwrap().len();
        // Cut inside `a`: `z` is still whole, `a` and `m` are not.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len - 5 - 3)
            .unwrap();
        assert_eq!(f.read("z").unwrap().as_slice(), &bytes[..24], "{backend:?}");
        for name in ["a", "m"] {
            match f.read(name) {
                Err(Error::Checkpoint { path: p, reason }) => {
                    assert_eq!(p, path);
                    assert_contains(&reason, &format!("tensor {name:?}"));
                    assert_contains(&reason, "truncated or rewritten in place while open");
                }
                Err(e) => panic!("{backend:?} {name}: {e:?}"),
                Ok(_) => panic!("{backend:?} {name}: read past the end of a truncated file"),
            }
        }
    }
}

#[cfg(unix)]
#[test]
fn a_fifo_is_refused_without_blocking() {
    let dir = TempDir::new("fifo");
    let fifo = dir.path().join("model.safetensors");
    let status = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !matches!(status, Ok(s) if s.success()) {
        return; // no mkfifo here
    }
    for backend in BACKENDS {
        for r in [
            Checkpoint::open(&fifo, backend).map(|_| ()),
            Checkpoint::open(dir.path(), backend).map(|_| ()),
        ] {
            match r {
                Err(Error::Io { path, source }) => {
                    assert_eq!(path, fifo);
                    assert_eq!(source.kind(), std::io::ErrorKind::InvalidInput);
                    assert_contains(&source.to_string(), "not a regular file");
                }
                Err(e) => panic!("{e:?}"),
                Ok(_) => panic!("opened a FIFO"),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Column blocks (`read_spans`) and the read counter.
// ---------------------------------------------------------------------------------------------

/// One file holding `w` U8 [rows, cols], byte (r, c) = data(rows * cols, 3)[r * cols + c].
fn matrix_file(dir: &TempDir, rows: usize, cols: usize) -> (PathBuf, Vec<u8>, u64) {
    let h = header_for(&[("w", "U8", &[rows, cols])]);
    let bytes = data(rows * cols, 3);
    let file = st(&h, &bytes);
    let header_bytes = (file.len() - bytes.len()) as u64;
    (dir.write("w.safetensors", &file), bytes, header_bytes)
}

fn column_block(bytes: &[u8], cols: usize, lo: usize, hi: usize) -> Vec<u8> {
    bytes
        .chunks_exact(cols)
        .flat_map(|row| row[lo..hi].to_vec())
        .collect()
}

#[test]
fn read_spans_gives_a_column_block_on_both_backends() {
    let dir = TempDir::new("spans");
    // 6 MiB: large enough for the parallel pread path.
    let (rows, cols) = (3072, 2048);
    let (path, bytes, _) = matrix_file(&dir, rows, cols);
    for backend in BACKENDS {
        let ckpt = Checkpoint::open(&path, backend).unwrap();
        for (lo, hi) in [(0, 1024), (1024, 2048), (682, 1365), (0, 2048), (5, 5)] {
            let got = ckpt.read_spans("w", lo, hi - lo, cols, rows).unwrap();
            assert_eq!(
                got.as_slice(),
                column_block(&bytes, cols, lo, hi),
                "{backend:?} {lo}..{hi}"
            );
        }
        // A small block (sequential path) and a single span.
        let got = ckpt.read_spans("w", cols + 7, 9, cols, 4).unwrap();
        assert_eq!(
            got.as_slice(),
            column_block(&bytes[cols..5 * cols], cols, 7, 16)
        );
        let one = ckpt.read_spans("w", 11, 5, cols, 1).unwrap();
        assert_eq!(one.as_slice(), &bytes[11..16]);
    }
}

#[test]
fn read_spans_refuses_ranges_past_the_tensor_and_overlapping_spans() {
    let dir = TempDir::new("spans-bad");
    let (path, _, _) = matrix_file(&dir, 4, 8);
    for backend in BACKENDS {
        let ckpt = Checkpoint::open(&path, backend).unwrap();
        let past = ckpt.read_spans("w", 4, 5, 8, 4).err().unwrap();
        assert!(matches!(past, Error::Checkpoint { .. }), "{past}");
        assert!(past.to_string().contains("past its 32 bytes"), "{past}");
        let overlap = ckpt.read_spans("w", 0, 9, 8, 2).err().unwrap();
        assert!(overlap.to_string().contains("overlap"), "{overlap}");
        let missing = ckpt.read_spans("nope", 0, 1, 1, 1).err().unwrap();
        assert!(matches!(missing, Error::TensorNotFound { .. }));
    }
}

#[test]
fn read_spans_refuses_an_end_offset_that_overflows() {
    let dir = TempDir::new("spans-overflow");
    let (path, _, _) = matrix_file(&dir, 4, 8);
    let max = usize::MAX;
    for backend in BACKENDS {
        let ckpt = Checkpoint::open(&path, backend).unwrap();
        // (count - 1) * stride, + start, + span: each step overflowing on its own.
        for (start, span, stride, count) in [
            (0, 1, max, 3),
            (0, 1, max / 2 + 1, 3),
            (max, 1, 1, 2),
            (1, max, max, 2),
            (0, 0, max, max),
            (max, max, max, max),
        ] {
            let err = ckpt
                .read_spans("w", start, span, stride, count)
                .err()
                .unwrap();
            assert!(matches!(err, Error::Checkpoint { .. }), "{err}");
            assert!(err.to_string().contains("overflows"), "{err}");
        }
        // A start past the tensor with no spans, or an empty span past it: refused, no panic.
        let past = ckpt.read_spans("w", max, 0, 0, 0).err().unwrap();
        assert!(past.to_string().contains("past its 32 bytes"), "{past}");
        // At the edge: the last span ending exactly at the tensor's end is read.
        let edge = ckpt.read_spans("w", 7, 1, 8, 4).unwrap();
        assert_eq!(edge.as_slice().len(), 4);
    }
}

#[test]
fn read_spans_refuses_a_file_truncated_while_open() {
    let dir = TempDir::new("spans-trunc");
    let (path, bytes, header) = matrix_file(&dir, 64, 64);
    let ckpt = Checkpoint::open(&path, Backend::Pread).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(header + bytes.len() as u64 - 100).unwrap();
    let err = ckpt.read_spans("w", 0, 16, 64, 64).err().unwrap();
    assert!(err.to_string().contains("truncated"), "{err}");
}

#[test]
fn bytes_read_counts_the_header_and_only_the_pread_bytes_asked_for() {
    let dir = TempDir::new("bytes-read");
    let (rows, cols) = (256, 512);
    let (path, _, header) = matrix_file(&dir, rows, cols);
    let pread = Checkpoint::open(&path, Backend::Pread).unwrap();
    assert_eq!(pread.bytes_read(), header, "the header at open");
    pread.read_range("w", 1024..3072).unwrap();
    assert_eq!(pread.bytes_read(), header + 2048);
    pread.read_spans("w", 128, 128, cols, rows).unwrap();
    assert_eq!(pread.bytes_read(), header + 2048 + 128 * rows as u64);
    let mapped = Checkpoint::open(&path, Backend::Mmap).unwrap();
    mapped.read("w").unwrap();
    mapped.read_spans("w", 128, 128, cols, rows).unwrap();
    assert_eq!(
        mapped.bytes_read(),
        header,
        "mapped pages are not read calls"
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// Any column block of any small matrix, on both backends, is the block and costs (pread)
    /// exactly its bytes.
    #[test]
    fn read_spans_is_the_column_block(
        rows in 1usize..40,
        cols in 1usize..40,
        a in 0usize..40,
        b in 0usize..40,
    ) {
        let (lo, hi) = (a.min(b) % (cols + 1), a.max(b).min(cols));
        let (lo, hi) = (lo.min(hi), hi);
        let dir = TempDir::new("spans-prop");
        let (path, bytes, header) = matrix_file(&dir, rows, cols);
        for backend in BACKENDS {
            let ckpt = Checkpoint::open(&path, backend).unwrap();
            let got = ckpt.read_spans("w", lo, hi - lo, cols, rows).unwrap();
            proptest::prop_assert_eq!(got.as_slice(), column_block(&bytes, cols, lo, hi));
            let counted = if backend == Backend::Pread { (rows * (hi - lo)) as u64 } else { 0 };
            proptest::prop_assert_eq!(ckpt.bytes_read(), header + counted);
        }
    }

    /// Any arguments at all (huge ones, whose end offset overflows, included): `read_spans`
    /// returns the spans or an error, never panics, and both backends agree; `read_range`
    /// likewise.
    #[test]
    fn read_spans_and_read_range_take_any_arguments(
        start in spans_arg(),
        span in spans_arg(),
        stride in spans_arg(),
        count in spans_arg(),
    ) {
        let dir = TempDir::new("spans-any");
        let (path, bytes, _) = matrix_file(&dir, 4, 8);
        let [mapped, copied] = BACKENDS.map(|b| Checkpoint::open(&path, b).unwrap());
        let (m, c) = (
            mapped.read_spans("w", start, span, stride, count),
            copied.read_spans("w", start, span, stride, count),
        );
        match (&m, &c) {
            (Ok(m), Ok(c)) => {
                // Empty spans may come in any number: only non-empty ones are counted out.
                let spans = if span == 0 { 0 } else { count };
                let want: Vec<u8> = (0..spans)
                    .flat_map(|i| bytes[start + i * stride..][..span].to_vec())
                    .collect();
                proptest::prop_assert_eq!(m.as_slice(), &want[..]);
                proptest::prop_assert_eq!(c.as_slice(), &want[..]);
            }
            (Err(m), Err(c)) => proptest::prop_assert_eq!(m.to_string(), c.to_string()),
            _ => proptest::prop_assert!(false, "backends disagree: {:?} {:?}", m.is_ok(), c.is_ok()),
        }
        let part = start..span;
        match (mapped.read_range("w", part.clone()), copied.read_range("w", part.clone())) {
            (Ok(m), Ok(c)) => {
                let want = &bytes[start..span.min(bytes.len())];
                proptest::prop_assert_eq!(m.as_slice(), want);
                proptest::prop_assert_eq!(c.as_slice(), want);
            }
            (Err(m), Err(c)) => proptest::prop_assert_eq!(m.to_string(), c.to_string()),
            _ => proptest::prop_assert!(false, "backends disagree on read_range {part:?}"),
        }
    }
}

/// A `read_spans` argument: small (in and around a 32-byte tensor) or anywhere up to
/// `usize::MAX`, where sums and products overflow.
fn spans_arg() -> impl proptest::strategy::Strategy<Value = usize> {
    use proptest::prelude::*;
    prop_oneof![
        0usize..40,
        Just(usize::MAX),
        usize::MAX - 40..=usize::MAX,
        any::<usize>()
    ]
}

#[test]
fn parse_index_lists_each_file_once_in_linear_time() {
    // 20,000 tensors over 20,000 distinct files: a list lookup per name was quadratic.
    let map: serde_json::Map<String, serde_json::Value> = (0..20_000)
        .map(|i| (format!("t{i}"), json!(format!("f{i}.safetensors"))))
        .collect();
    let text = json!({ "weight_map": map }).to_string();
    let parsed = parse_index(Path::new("index.json"), text.as_bytes()).unwrap();
    assert_eq!(parsed.file_names.len(), 20_000);
    assert!(parsed.file_names.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(parsed.wanted["t7"], "f7.safetensors");
    assert_eq!(parsed.first_tensor["f7.safetensors"], "t7");
}

#[test]
fn refuses_an_index_nested_too_deep_or_too_large() {
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let err = parse_index(Path::new("index.json"), deep.as_bytes()).unwrap_err();
    assert_contains(&err.to_string(), "recursion limit");
    let dir = TempDir::new("index-huge");
    two_shards(&dir);
    let file = File::create(dir.path().join(INDEX_NAME)).unwrap();
    file.set_len(MAX_INDEX_BYTES + 1).unwrap();
    assert_contains(&index_err(&dir), "more than the 100000000 bytes");
}
