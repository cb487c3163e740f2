//! Refusals of one malformed file, each with its error variant and reason.

use super::*;

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

/// A file of `header` and `data_len` zero bytes is refused as an invalid header.
fn assert_invalid_header(header: &serde_json::Value, data_len: usize) {
    assert_contains(&refused(&st(header, &vec![0; data_len])), "invalid header");
}

#[test]
fn refuses_an_unknown_dtype() {
    assert_invalid_header(
        &json!({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}}),
        2,
    );
}

#[test]
fn refuses_a_byte_range_that_disagrees_with_the_shape() {
    // F32 [3] is 12 bytes, the offsets say 8.
    assert_invalid_header(&size_mismatch_header(), 8);
    // Missing fields.
    assert_invalid_header(&json!({"w": {"dtype": "F32", "shape": [2]}}), 8);
    // A shape whose byte size overflows.
    assert_invalid_header(
        &json!({"w": {"dtype": "F32", "shape": [u64::MAX, 4], "data_offsets": [0, 8]}}),
        8,
    );
}

#[test]
fn refuses_overlapping_tensors() {
    assert_invalid_header(&overlapping_header(), 12);
}

#[test]
fn refuses_a_gap_between_tensors() {
    assert_invalid_header(&gapped_header(), 12);
    // Data that does not start at offset 0.
    assert_invalid_header(&late_start_header(), 8);
}

/// The refusal of a file of `header` and `data_len` zero bytes, where the header describes
/// `described` data bytes: the reason, checked to give both file lengths (8 + header + data).
fn length_refusal(header: &serde_json::Value, data_len: usize, described: usize) -> String {
    let header_len = header.to_string().len();
    let reason = refused(&st(header, &vec![0; data_len]));
    assert_contains(
        &reason,
        &format!(
            "the header describes {} bytes but the file has {}",
            8 + header_len + described,
            8 + header_len + data_len
        ),
    );
    reason
}

#[test]
fn refuses_offsets_past_the_end_of_the_file() {
    let h = header_for(&[("a", "F32", &[2]), ("b", "U8", &[4])]);
    assert_contains(&length_refusal(&h, 8, 12), "truncated");
}

#[test]
fn refuses_trailing_bytes() {
    length_refusal(&header_for(&[("a", "F32", &[2])]), 9, 8);
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
    assert_invalid_header(&json!({"__metadata__": {"n": 3}}), 0);
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
                Err(e @ Error::Io { .. }) => {
                    // One wording for a missing path, not the OS's "(os error 2)".
                    assert_eq!(
                        e.to_string(),
                        format!("{}: no such file or directory", path.display())
                    );
                    let Error::Io { path: p, source } = e else {
                        unreachable!()
                    };
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
