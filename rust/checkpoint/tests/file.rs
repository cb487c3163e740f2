//! One file: round trips on both backends, and paths that are not regular files (files that
//! change while open: `changed`).

use super::*;

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

/// A tensor larger than the allocator can give is an error naming it with the pread backend,
/// never an abort of the process (`vec![0u8; n]` aborts). A sparse file declares 1 TiB; the
/// kernel refuses that calloc when it refuses obvious overcommits (modes 0 and 2), so the test
/// runs only there and where the file system takes a 1 TiB sparse file.
#[test]
fn a_tensor_too_large_to_allocate_is_an_error_not_an_abort() {
    let overcommit = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").unwrap_or_default();
    if !matches!(overcommit.trim(), "0" | "2") {
        return;
    }
    let len: usize = 1 << 40;
    let dir = TempDir::new("huge");
    let header = header_for(&[("huge", "U8", &[len])]);
    let path = dir.write("huge.safetensors", &st(&header, &[]));
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let prefix = std::fs::metadata(&path).unwrap().len();
    if file.set_len(prefix + len as u64).is_err() {
        return;
    }
    drop(file);
    let f = SafetensorsFile::open(&path, Backend::Pread).unwrap();
    for result in [f.read("huge"), f.read_spans("huge", 0, 1, 2, len / 2)] {
        match result {
            Err(Error::Checkpoint { reason, .. }) => {
                assert_contains(&reason, "tensor \"huge\": its ");
                assert_contains(&reason, "cannot be allocated");
            }
            Err(other) => panic!("expected a Checkpoint error, got {other:?}"),
            Ok(_) => panic!("a 1 TiB read was allocated"),
        }
    }
}

#[test]
fn writable_reads_are_copy_on_write_and_leave_the_file_and_reads_alone() {
    let dir = TempDir::new("cow");
    let (path, bytes) = three_tensor_file(&dir, "w.safetensors", 5);
    for backend in [Backend::Mmap, Backend::Pread] {
        let file = SafetensorsFile::open(&path, backend).unwrap();
        let w = file.read_writable("z", 0..usize::MAX).unwrap();
        let (address, len) = w.address();
        assert_eq!(len, 24);
        // SAFETY: `w` owns `len` writable bytes at `address` (a private copy-on-write mapping or
        // an owned copy) while it lives; nothing else borrows them.
        let written = unsafe { std::slice::from_raw_parts_mut(address as *mut u8, len) };
        assert_eq!(&written[..], &bytes[0..24]);
        written.fill(0xA5);
        assert_eq!(
            file.read("z").unwrap().as_slice(),
            &bytes[0..24],
            "{backend:?}"
        );
        let again = file.read_writable("z", 0..4).unwrap();
        assert_eq!(again.address().1, 4);
    }
    let on_disk = std::fs::read(&path).unwrap();
    let fresh = SafetensorsFile::open(&path, Backend::Pread).unwrap();
    assert_eq!(fresh.read("z").unwrap().as_slice(), &bytes[0..24]);
    assert!(!on_disk.windows(24).any(|w| w.iter().all(|&b| b == 0xA5)));
}
