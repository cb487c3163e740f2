//! Index parsing from memory: the input is a whole `model.safetensors.index.json`.
//! `parse_index` must never panic, and must finish in time linear in the input (libFuzzer's
//! -timeout catches a quadratic path); when it accepts, every file name is a plain relative
//! path, listed once, sorted, and every tensor maps to one of them.
#![no_main]

use std::path::{Component, Path};

use kda_tp::checkpoint::parse_index;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &[u8]| {
    let Ok(map) = parse_index(Path::new("fuzz.index.json"), text) else {
        return;
    };
    assert!(map.file_names.windows(2).all(|w| w[0] < w[1]), "sorted, each once");
    for name in &map.file_names {
        assert!(!name.is_empty());
        assert!(Path::new(name)
            .components()
            .all(|c| matches!(c, Component::Normal(_))));
        let first = &map.first_tensor[name];
        assert_eq!(&map.wanted[first], name, "{name}: its first tensor maps to it");
    }
    for file in map.wanted.values() {
        assert!(map.file_names.binary_search(file).is_ok(), "{file} listed");
    }
    assert_eq!(map.first_tensor.len(), map.file_names.len());
});
