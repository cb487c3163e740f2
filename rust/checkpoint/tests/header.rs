//! Named refusals from `parse_header` (no file I/O), and its fast and slow paths agreeing.

use super::*;
use crate::checkpoint::header::{typed_entries, value_entries, ParsedHeader};

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

/// Each refusal names the tensor at fault: `(header, data_len, what the reason contains)`.
#[test]
fn parse_header_names_the_tensor() {
    let two = header_for(&[("a", "F32", &[2]), ("b", "U8", &[4])]);
    let cases = [
        (
            json!({"ok": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                   "odd": {"dtype": "Q7", "shape": [2], "data_offsets": [1, 3]}}),
            3,
            "tensor \"odd\": unknown variant",
        ),
        (
            size_mismatch_header(),
            8,
            "tensor \"w\": shape [3] of F32 is 12 bytes, but its data_offsets [0, 8] span 8 bytes",
        ),
        (
            json!({"w": {"dtype": "U8", "shape": [0], "data_offsets": [8, 0]}}),
            8,
            "end before they begin",
        ),
        (
            json!({"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}),
            2,
            "not a whole number of bytes",
        ),
        (
            json!({"w": {"dtype": "F32", "shape": [1u64 << 40, 1u64 << 40], "data_offsets": [0, 8]}}),
            8,
            "tensor \"w\": shape",
        ),
        (
            overlapping_header(),
            12,
            "tensor \"b\" (data bytes [4, 12)) overlaps tensor \"a\"",
        ),
        (gapped_header(), 12, "a gap of 4 bytes between tensor \"a\""),
        (
            late_start_header(),
            8,
            "between the start of the data section",
        ),
        (
            two.clone(),
            10,
            "tensor \"b\" ends at data byte 12, past the 10 data bytes",
        ),
        (two, 13, "(1 trailing bytes after the data)"),
    ];
    for (h, data_len, want) in cases {
        assert_contains(&header_err(h.to_string().as_bytes(), data_len), want);
    }
}

/// A shape numpy cannot hold is refused at the header, naming the tensor: more than 32 axes
/// (numpy 1.x's limit; kda_tp supports numpy 1.24 on), or an empty tensor whose other axes
/// exceed numpy's size (which the safetensors crate accepts: its byte size is 0). 32 unit axes,
/// and an empty tensor within numpy's size, are read as usual.
#[test]
fn shapes_numpy_cannot_hold_are_refused() {
    let unit = |n: usize| {
        json!({"ok": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
               "w": {"dtype": "BF16", "shape": vec![1; n], "data_offsets": [2, 4]}})
    };
    for n in [33, 65, 1000] {
        assert_contains(
            &header_err(unit(n).to_string().as_bytes(), 4),
            &format!(
                "tensor \"w\" has {n} axes, more than the 32 kda_tp reads (numpy 1.x holds at \
                 most 32 axes, numpy 2 at most 64)"
            ),
        );
    }
    let m = parse_header(Path::new("m"), unit(32).to_string().as_bytes(), 4).unwrap();
    assert_eq!(m.info("w").unwrap().shape.len(), 32);
    let empty = |shape: serde_json::Value| json!({"e": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}});
    for (shape, shown) in [
        (
            json!([0, 1u64 << 40, 1u64 << 40]),
            "[0, 1099511627776, 1099511627776]",
        ),
        (json!([1u64 << 62, 0, 2]), "[4611686018427387904, 0, 2]"),
    ] {
        assert_contains(
            &header_err(empty(shape).to_string().as_bytes(), 0),
            &format!("tensor \"e\": shape {shown} of F32 is too large for numpy"),
        );
    }
    let m = parse_header(
        Path::new("m"),
        empty(json!([0, 1u64 << 40])).to_string().as_bytes(),
        0,
    )
    .unwrap();
    assert_eq!(m.info("e").unwrap().shape, [0, 1 << 40]);
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
