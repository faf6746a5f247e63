//! The seal: one input staged into two directories digests to one address.

use kiln_core::digest::{digest_dir, TreeDigest, WalkOptions};
use kiln_core::seal::{seal, SealError, SealSpec};
use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;
use tempfile::TempDir;

/// What a package manager's deploy does to a staging directory: copies the input and leaves records
/// of where (shims, config) and when (a state file) it ran.
fn stage(staging: &Path, recorded_as: &Path, minute: u32) {
    fs::create_dir_all(staging.join("node_modules/.bin")).unwrap();
    fs::create_dir_all(staging.join("node_modules/lib")).unwrap();
    fs::write(staging.join("index.js"), "console.log('hi')\n").unwrap();
    fs::write(staging.join("node_modules/lib/index.js"), "module.exports = 1\n").unwrap();
    let shim = format!("#!/bin/sh\nNODE_PATH={}/node_modules exec node \"$@\"\n", recorded_as.display());
    fs::write(staging.join("node_modules/.bin/tool"), shim).unwrap();
    let state = format!("stagedAt: 2026-11-29T10:{minute:02}:00Z\nroot: {}\n", recorded_as.display());
    fs::write(staging.join("node_modules/.modules.yaml"), state).unwrap();
    let config = format!("{{\"root\": \"{}/app\", \"name\": \"shop\"}}\n", recorded_as.display());
    fs::write(staging.join("config.json"), config).unwrap();
}

fn spec(staging: &Path) -> SealSpec {
    SealSpec {
        staging_path: staging.to_path_buf(),
        delete: vec!["**/.bin".into(), "node_modules/.modules.yaml".into()],
        in_image_path: Some("/srv/app".into()),
    }
}

fn digest(dir: &Path) -> TreeDigest {
    digest_dir(dir, &WalkOptions::default()).unwrap().1
}

#[test]
fn one_input_staged_into_two_directories_gets_one_digest() {
    let a = TempDir::new().unwrap();
    let b = TempDir::new().unwrap();
    stage(a.path(), a.path(), 1);
    stage(b.path(), b.path(), 7);
    assert_ne!(digest(a.path()), digest(b.path()), "unsealed, the staging records make the digests differ");

    let report_a = seal(a.path(), &spec(a.path())).unwrap();
    seal(b.path(), &spec(b.path())).unwrap();
    assert_eq!(digest(a.path()), digest(b.path()));
    assert_eq!(report_a.deleted, vec!["node_modules/.bin".to_string(), "node_modules/.modules.yaml".to_string()]);
    assert_eq!(report_a.rewritten, vec!["config.json".to_string()]);
    let config = fs::read_to_string(a.path().join("config.json")).unwrap();
    assert_eq!(config, "{\"root\": \"/srv/app/app\", \"name\": \"shop\"}\n");
}

#[test]
fn the_resolved_spelling_of_the_staging_path_is_rewritten_too() {
    let real = TempDir::new().unwrap();
    let links = TempDir::new().unwrap();
    let via_link = links.path().join("stage");
    symlink(real.path(), &via_link).unwrap();
    // The tool was handed the link but recorded the resolved path.
    stage(real.path(), &fs::canonicalize(real.path()).unwrap(), 3);
    let report = seal(real.path(), &spec(&via_link)).unwrap();
    assert_eq!(report.rewritten, vec!["config.json".to_string()]);
    assert!(!fs::read_to_string(real.path().join("config.json")).unwrap().contains(real.path().to_str().unwrap()));
}

#[test]
fn a_symlink_naming_the_staging_path_is_refused() {
    let a = TempDir::new().unwrap();
    stage(a.path(), a.path(), 1);
    symlink(a.path().join("index.js"), a.path().join("entry")).unwrap();
    let err = seal(a.path(), &spec(a.path())).unwrap_err();
    assert!(matches!(err, SealError::SymlinkNamesStaging { ref path, .. } if path == "entry"), "{err}");
}

#[test]
fn a_non_utf8_file_holding_the_staging_path_fails_naming_it() {
    let a = TempDir::new().unwrap();
    stage(a.path(), a.path(), 1);
    let mut bytes = vec![0xff, 0xfe, 0x00];
    bytes.extend_from_slice(a.path().to_str().unwrap().as_bytes());
    fs::write(a.path().join("native.node"), &bytes).unwrap();
    let err = seal(a.path(), &spec(a.path())).unwrap_err();
    assert!(matches!(err, SealError::NonUtf8 { ref path, .. } if path == "native.node"), "{err}");
    assert_eq!(fs::read(a.path().join("native.node")).unwrap(), bytes, "the file is left as it was");
}

#[test]
fn files_without_the_staging_path_are_untouched() {
    let a = TempDir::new().unwrap();
    fs::write(a.path().join("plain.bin"), [0xffu8, 0x00, 0x01]).unwrap();
    fs::write(a.path().join("plain.txt"), "nothing to see").unwrap();
    let report = seal(a.path(), &spec(a.path())).unwrap();
    assert!(report.rewritten.is_empty() && report.deleted.is_empty());
}

#[test]
fn without_an_in_image_path_a_text_file_holding_the_staging_path_is_refused_and_left_alone() {
    let a = TempDir::new().unwrap();
    stage(a.path(), a.path(), 1);
    let before = fs::read(a.path().join("config.json")).unwrap();
    let err = seal(a.path(), &SealSpec { in_image_path: None, ..spec(a.path()) }).unwrap_err();
    assert!(matches!(err, SealError::HoldsStaging { ref path, .. } if path == "config.json"), "{err}");
    assert!(err.to_string().contains("declare the path the tree has in the image"), "{err}");
    assert_eq!(fs::read(a.path().join("config.json")).unwrap(), before, "nothing is guessed");
}
