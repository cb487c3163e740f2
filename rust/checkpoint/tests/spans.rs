//! Column blocks (`read_spans`) and the read counter.

use super::*;

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
    assert!(
        err.to_string().contains("changed since it was opened"),
        "{err}"
    );
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
