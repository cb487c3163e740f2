//! Checkpoints: a single file, a directory with one file, a directory with an index (and the
//! index parsed from memory).

use super::*;

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

/// A fresh directory holding [`two_shards`] (and no index yet).
fn sharded_dir(tag: &str) -> TempDir {
    let dir = TempDir::new(tag);
    two_shards(&dir);
    dir
}

/// Writes `index` as the directory's index and returns the reason the checkpoint is refused.
fn index_refusal(dir: &TempDir, index: &[u8]) -> String {
    dir.write(INDEX_NAME, index);
    index_err(dir)
}

fn index_err(dir: &TempDir) -> String {
    let (path, reason) = checkpoint_err(dir.path());
    assert_eq!(path, dir.path().join(INDEX_NAME));
    reason
}

#[test]
fn refuses_an_index_that_is_not_json() {
    let dir = sharded_dir("index-notjson");
    assert_contains(&index_refusal(&dir, b"{\"weight_map\": "), "not JSON");
}

#[test]
fn refuses_an_index_without_a_weight_map() {
    let dir = sharded_dir("index-nomap");
    for index in [
        &br#"{"metadata": {}}"#[..],
        br#"{"weight_map": ["a"]}"#,
        b"[]",
    ] {
        assert_contains(&index_refusal(&dir, index), "no \"weight_map\" object");
    }
}

#[test]
fn refuses_a_weight_map_entry_that_is_not_a_string() {
    let dir = sharded_dir("index-nonstring");
    write_index(&dir, json!({"a": F1, "b": F1, "c": 2}));
    assert_contains(&index_err(&dir), "weight_map[\"c\"] is not a file name");
}

#[test]
fn refuses_an_index_naming_a_missing_file() {
    let dir = sharded_dir("index-missing");
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
    let dir = sharded_dir("index-lacks");
    write_index(&dir, json!({"a": F1, "b": F1, "c": F1}));
    let reason = index_err(&dir);
    assert_contains(
        &reason,
        &format!("maps tensor \"c\" to {F1}, which has no such tensor"),
    );
}

#[test]
fn refuses_paths_that_leave_the_directory() {
    let dir = sharded_dir("index-escape");
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
    let dir = sharded_dir("index-symlink");
    let outside = TempDir::new("index-symlink-target");
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
    let dir = sharded_dir("index-unlisted");
    write_index(&dir, json!({"a": F1, "c": F2}));
    assert_contains(
        &index_err(&dir),
        &format!("{F1} holds tensor \"b\", which the index maps to no file"),
    );
}

#[test]
fn refuses_a_tensor_held_by_two_files() {
    let dir = sharded_dir("index-twice");
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
    let dir = sharded_dir("index-badshard");
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
    let dir = sharded_dir("index-huge");
    let file = File::create(dir.path().join(INDEX_NAME)).unwrap();
    file.set_len(MAX_INDEX_BYTES + 1).unwrap();
    assert_contains(&index_err(&dir), "more than the 100000000 bytes");
}
