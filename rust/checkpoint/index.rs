//! The `model.safetensors.index.json` of a sharded checkpoint, parsed and checked from memory.

use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path};

use crate::error::{Error, Result};

/// The index file of a sharded Hugging Face checkpoint.
pub const INDEX_NAME: &str = "model.safetensors.index.json";

/// Largest `model.safetensors.index.json` read, in bytes: 100 MB, the safetensors crate's limit
/// on one header (a real index of 100,000 tensors is about 10 MB).
pub const MAX_INDEX_BYTES: u64 = 100_000_000;

/// The `weight_map` of a `model.safetensors.index.json`, checked (see [`parse_index`]).
#[derive(Debug)]
pub struct WeightMap {
    /// The distinct file names, sorted.
    pub file_names: Vec<String>,
    /// Tensor name -> file name.
    pub wanted: BTreeMap<String, String>,
    /// File name -> the first tensor (in document order) mapped to it, named in errors.
    pub first_tensor: HashMap<String, String>,
}

/// Parses and checks a `model.safetensors.index.json` from memory (no file I/O): JSON (nested
/// at most serde_json's 128 levels), a `"weight_map"` object whose every value is a plain
/// relative file name (no `..`, no root, not empty). Linear in the document: each file name is
/// looked up in a hash map, not in the list of names seen. Public so that fuzzers can drive
/// it; [`Checkpoint::open`] then checks the files against it.
///
/// # Errors
/// [`Error::Checkpoint`] naming `index_path`, for each refusal above.
///
/// [`Checkpoint::open`]: super::Checkpoint::open
pub fn parse_index(index_path: &Path, text: &[u8]) -> Result<WeightMap> {
    let bad = |reason: String| Error::Checkpoint {
        path: index_path.to_path_buf(),
        reason,
    };
    let json: serde_json::Value =
        serde_json::from_slice(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let weight_map = json
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
    let mut first_tensor: HashMap<String, String> = HashMap::new();
    let mut wanted = BTreeMap::new();
    for (tensor, file) in weight_map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("weight_map[{tensor:?}] is not a file name")))?;
        let relative = Path::new(file);
        if file.is_empty()
            || !relative
                .components()
                .all(|c| matches!(c, Component::Normal(_)))
        {
            return Err(bad(format!(
                "weight_map[{tensor:?}] = {file:?} is not a plain relative path inside the \
                 checkpoint directory"
            )));
        }
        first_tensor
            .entry(file.to_string())
            .or_insert_with(|| tensor.clone());
        wanted.insert(tensor.clone(), file.to_string());
    }
    let mut file_names: Vec<String> = first_tensor.keys().cloned().collect();
    file_names.sort_unstable();
    Ok(WeightMap {
        file_names,
        wanted,
        first_tensor,
    })
}
