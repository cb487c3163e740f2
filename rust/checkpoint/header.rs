//! Parsing and validating a safetensors header from memory: one validator (the safetensors
//! crate's), the checks it does not make, and its refusals worded for the user.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::Path;

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::SafeTensorError;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};

use crate::error::{Error, Result};

/// The header key of the user metadata map (every other key is a tensor).
const METADATA_KEY: &str = "__metadata__";

/// The most axes a stored tensor may have: numpy 1.x holds at most 32 (numpy 2 at most 64), and
/// kda_tp (which supports numpy 1.24 on) hands tensors out as numpy arrays. torch holds more,
/// but no checkpoint kda_tp could read needs them: real weights have at most a handful.
const MAX_AXES: usize = 32;

/// Parses and validates the JSON header of a safetensors file, from memory (no file I/O).
///
/// `header` is the header's bytes (what follows the 8-byte length prefix, `header.len()` being
/// that length) and `data_len` the number of bytes after the header in the file. Checks what
/// [`SafetensorsFile::open`] promises about a header: UTF-8, a JSON object, no name twice, a
/// `__metadata__` string map (or `null`, read as no metadata), every tensor entry a known dtype
/// with a shape whose byte size (sub-byte dtypes such as F4 included, by bits) equals its
/// `data_offsets` range (no overflow) and that numpy can hold (at most 32 axes, and its non-zero
/// axes' product of bytes within `isize::MAX`, as numpy checks even for an empty array), the
/// tensors back to back from data byte 0 with no gap or overlap, and their total exactly
/// `data_len` (neither past the end of the file nor followed by trailing bytes). Errors are
/// [`Error::Safetensors`] naming `path` and, where there is one, the tensor. Public so that
/// fuzzers can drive header parsing from memory.
///
/// One validator: the entries' sizes and offsets are checked once, by the safetensors crate
/// (`Metadata::new`); this function checks only what that does not (JSON shape, duplicate
/// names, the metadata map, shapes numpy can hold, the data section's length), and words a
/// refusal of the crate's (which names no tensor or offset) for the user (`explain_refusal`, on
/// that path only).
///
/// # Errors
/// [`Error::Safetensors`] for each refusal above.
///
/// [`SafetensorsFile::open`]: super::SafetensorsFile::open
pub fn parse_header(path: &Path, header: &[u8], data_len: u64) -> Result<Metadata> {
    let bad = |reason: String| Error::Safetensors {
        path: path.to_path_buf(),
        reason,
    };
    let (user_metadata, tensors) = header_entries(path, header)?;
    for (name, info) in &tensors {
        check_shape(name, info).map_err(|reason| bad(format!("invalid header: {reason}")))?;
    }
    let metadata = Metadata::new(user_metadata, tensors)
        .map_err(|refusal| explain_refusal(path, header, &refusal))?;
    // Back to back from data byte 0 (checked above): the data section is the last end offset.
    let described = metadata.data_len();
    let prefix = 8 + header.len() as u128;
    let file_len = prefix + u128::from(data_len);
    let described_total = prefix + described as u128;
    if described as u128 > u128::from(data_len) {
        let (name, end) = metadata
            .offset_keys()
            .into_iter()
            .filter_map(|name| {
                let end = metadata.info(&name)?.data_offsets.1;
                (end as u128 > u128::from(data_len)).then_some((name, end))
            })
            .next()
            .unwrap_or_default();
        return Err(bad(format!(
            "the header describes {described_total} bytes but the file has {file_len} \
             (truncated: tensor {name:?} ends at data byte {end}, past the {data_len} data bytes \
             after the header)"
        )));
    }
    if (described as u128) < u128::from(data_len) {
        return Err(bad(format!(
            "the header describes {described_total} bytes but the file has {file_len} \
             ({} trailing bytes after the data)",
            u128::from(data_len) - described as u128
        )));
    }
    Ok(metadata)
}

/// Refuses a shape numpy cannot hold (why: [`MAX_AXES`]): more than [`MAX_AXES`] axes, or an
/// empty tensor whose non-zero axes make more than `isize::MAX` bytes (the safetensors crate
/// accepts it, its byte size being 0, but numpy refuses it). A tensor with no zero axis is the
/// crate's to size: its bytes lie in the file, far below numpy's limit.
fn check_shape(name: &str, info: &TensorInfo) -> Result<(), String> {
    let (shape, dtype) = (&info.shape, info.dtype);
    if shape.len() > MAX_AXES {
        return Err(format!(
            "tensor {name:?} has {} axes, more than the {MAX_AXES} kda_tp reads (numpy 1.x \
             holds at most 32 axes, numpy 2 at most 64)",
            shape.len()
        ));
    }
    if !shape.contains(&0) {
        return Ok(());
    }
    let bits = shape
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(dtype.bitsize() as u128, |n, &d| n.checked_mul(d as u128));
    if bits.is_none_or(|bits| bits.div_ceil(8) > isize::MAX as u128) {
        return Err(format!(
            "tensor {name:?}: shape {shape:?} of {dtype} is too large for numpy (its non-zero \
             axes make more than {} bytes, although the tensor is empty)",
            isize::MAX
        ));
    }
    Ok(())
}

/// A header's `__metadata__` map and its tensor entries, in data order.
pub(super) type ParsedHeader = (Option<HashMap<String, String>>, Vec<(String, TensorInfo)>);

/// The header's `__metadata__` map and its tensor entries in data order (by offsets, then by
/// name, so that the order is deterministic): the checks that are not the safetensors crate's
/// (UTF-8, a JSON object, no name twice, the metadata a map of strings, each entry's fields).
fn header_entries(path: &Path, header: &[u8]) -> Result<ParsedHeader> {
    let text = std::str::from_utf8(header).map_err(|e| Error::Safetensors {
        path: path.to_path_buf(),
        reason: format!("header is not UTF-8: {e}"),
    })?;
    // Something is wrong when the fast path gives up: parsed again, as JSON values entry by
    // entry, for the message.
    typed_entries(text).map_or_else(|| value_entries(path, text), Ok)
}

/// [`header_entries`]' slow path, which finds what is wrong: the header as JSON values (every
/// key seen, in document order), then each entry converted and refused with its name.
pub(super) fn value_entries(path: &Path, text: &str) -> Result<ParsedHeader> {
    let bad = |reason: String| Error::Safetensors {
        path: path.to_path_buf(),
        reason,
    };
    let HeaderEntries { entries, duplicate } =
        serde_json::from_str(text).map_err(|e| bad(format!("header is not a JSON object: {e}")))?;
    if let Some(name) = duplicate {
        return Err(bad(format!("tensor {name:?} appears twice in the header")));
    }
    let mut user_metadata = None;
    let mut tensors: Vec<(String, TensorInfo)> = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        if name == METADATA_KEY {
            // `null` is no metadata, as the reference reader has it (its field is an Option).
            if value.is_null() {
                continue;
            }
            let map = HashMap::<String, String>::deserialize(value).map_err(|e| {
                bad(format!(
                    "invalid header: {METADATA_KEY:?} is not a map of strings to strings: {e}"
                ))
            })?;
            user_metadata = Some(map);
            continue;
        }
        let info = TensorInfo::deserialize(value)
            .map_err(|e| bad(format!("invalid header: tensor {name:?}: {e}")))?;
        tensors.push((name, info));
    }
    sort_in_data_order(&mut tensors);
    Ok((user_metadata, tensors))
}

/// Words a refusal of the safetensors crate's validation for the user: the first tensor, in
/// data order, that the crate refuses (its checks in its order: offsets that end before they
/// begin, overlap the previous tensor or leave a gap after it, then a byte size that overflows,
/// is not whole bytes or differs from the offsets), with its name and numbers. Runs only after
/// the crate refused, so a valid header is checked once.
fn explain_refusal(path: &Path, header: &[u8], refusal: &SafeTensorError) -> Error {
    let bad = |reason: String| Error::Safetensors {
        path: path.to_path_buf(),
        reason: format!("invalid header: {reason}"),
    };
    let tensors = match header_entries(path, header) {
        Ok((_, tensors)) => tensors,
        Err(e) => return e,
    };
    let mut described = 0usize;
    let mut previous: Option<&str> = None;
    for (name, info) in &tensors {
        let (begin, end) = info.data_offsets;
        let after = previous.map_or_else(
            || "the start of the data section".to_string(),
            |p| format!("tensor {p:?}"),
        );
        if end < begin {
            return bad(format!(
                "tensor {name:?} has data_offsets [{begin}, {end}], which end before they begin"
            ));
        }
        if begin < described {
            return bad(format!(
                "tensor {name:?} (data bytes [{begin}, {end})) overlaps {after}, which ends at \
                 data byte {described}"
            ));
        }
        if begin > described {
            return bad(format!(
                "a gap of {} bytes between {after} (ending at data byte {described}) and tensor \
                 {name:?} (starting at {begin})",
                begin - described
            ));
        }
        let bits = info
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_mul(info.dtype.bitsize()));
        let (shape, dtype) = (&info.shape, info.dtype);
        match bits {
            None => {
                return bad(format!(
                    "tensor {name:?}: shape {shape:?} of {dtype} overflows the byte size"
                ))
            }
            Some(bits) if bits % 8 != 0 => {
                return bad(format!(
                    "tensor {name:?}: shape {shape:?} of {dtype} is {bits} bits, not a whole \
                     number of bytes"
                ))
            }
            Some(bits) if bits / 8 != end - begin => {
                return bad(format!(
                    "tensor {name:?}: shape {shape:?} of {dtype} is {} bytes, but its \
                     data_offsets [{begin}, {end}] span {} bytes",
                    bits / 8,
                    end - begin
                ))
            }
            Some(_) => {}
        }
        described = end;
        previous = Some(name);
    }
    bad(refusal.to_string())
}

/// [`header_entries`]' fast path: the entries parsed straight into their types, in one pass with
/// no intermediate JSON values (about half the time on a header of 70,000 names), sorted in
/// data order. `None` for anything it does not accept: a duplicate name, a malformed entry,
/// not a JSON object; the slow path then finds and words the refusal.
pub(super) fn typed_entries(text: &str) -> Option<ParsedHeader> {
    struct Typed;
    impl<'de> Visitor<'de> for Typed {
        type Value = ParsedHeader;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ParsedHeader, A::Error> {
            let mut user_metadata: Option<Option<HashMap<String, String>>> = None;
            let mut tensors = Vec::with_capacity(map.size_hint().unwrap_or(0));
            while let Some(key) = map.next_key::<String>()? {
                if key == METADATA_KEY {
                    if user_metadata.is_some() {
                        return Err(serde::de::Error::custom("__metadata__ twice"));
                    }
                    user_metadata = Some(map.next_value()?);
                } else {
                    tensors.push((key, map.next_value::<TensorInfo>()?));
                }
            }
            Ok((user_metadata.flatten(), tensors))
        }
    }
    let mut json = serde_json::Deserializer::from_str(text);
    let (user_metadata, mut tensors) = (&mut json).deserialize_map(Typed).ok()?;
    // Nothing but whitespace after the object, as `serde_json::from_str` (the slow path) has it.
    json.end().ok()?;
    let mut seen = HashSet::with_capacity(tensors.len());
    if !tensors.iter().all(|(name, _)| seen.insert(name.as_str())) {
        return None;
    }
    sort_in_data_order(&mut tensors);
    Some((user_metadata, tensors))
}

/// Sorts tensor entries in data order: by offsets, then by name (zero-length tensors share an
/// offset), so that the order is deterministic.
fn sort_in_data_order(tensors: &mut [(String, TensorInfo)]) {
    tensors.sort_by(|(a, x), (b, y)| (x.data_offsets, a).cmp(&(y.data_offsets, b)));
}

/// A JSON object's entries in document order, and the first key seen twice (serde_json's own
/// maps would silently keep the last of two equal keys).
struct HeaderEntries {
    entries: Vec<(String, serde_json::Value)>,
    duplicate: Option<String>,
}

impl<'de> Deserialize<'de> for HeaderEntries {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = HeaderEntries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<HeaderEntries, A::Error> {
                let mut seen = HashSet::new();
                let mut entries = Vec::new();
                let mut duplicate = None;
                while let Some(key) = map.next_key::<String>()? {
                    let value = map.next_value::<serde_json::Value>()?;
                    if !seen.insert(key.clone()) {
                        duplicate.get_or_insert(key);
                    } else {
                        entries.push((key, value));
                    }
                }
                Ok(HeaderEntries { entries, duplicate })
            }
        }
        deserializer.deserialize_map(Entries)
    }
}
