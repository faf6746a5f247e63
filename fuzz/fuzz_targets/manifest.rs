//! Arbitrary text as `kiln.toml`: it resolves, or its error names the file and a line of it —
//! only the problems of the file as a whole (no instance, no target, no images) may name none.
//! No panic, and no unbounded time: run with `-timeout` (FUZZING.md).
//!
//! The manifest's folder holds contexts and Dockerfiles the seeds name (`api/`, `web/`,
//! `worker.Dockerfile`, a link to a context, a file where a context is expected), so resolution
//! reaches the checks made on disk.
#![no_main]

use kiln_core::manifest::{ImageSpec, Manifest, Problem};
use kiln_fuzz::scratch;
use libfuzzer_sys::fuzz_target;
use std::collections::HashSet;
use std::fs;
use std::path::PathBuf;
use std::sync::OnceLock;

fn folder() -> &'static (tempfile::TempDir, PathBuf) {
    static FOLDER: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    FOLDER.get_or_init(|| {
        let dir = scratch();
        let root = dir.path();
        for (path, contents) in [
            ("api/Dockerfile", "FROM scratch\n"),
            ("web/Dockerfile", "FROM scratch\n"),
            ("web/docker/web.Dockerfile", "FROM scratch\n"),
            ("worker/main.txt", "x"),
            ("worker.Dockerfile", "FROM scratch\n"),
            ("notadir", "x"),
        ] {
            fs::create_dir_all(root.join(path).parent().unwrap()).unwrap();
            fs::write(root.join(path), contents).unwrap();
        }
        std::os::unix::fs::symlink("api", root.join("api-link")).unwrap();
        std::os::unix::fs::symlink("/nonexistent", root.join("dangling")).unwrap();
        let path = root.join("kiln.toml");
        (dir, path)
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (_, path) = folder();
    match Manifest::parse(text, path) {
        Ok(manifest) => {
            assert!(!manifest.images.is_empty(), "a manifest without images resolved");
            let names: HashSet<&str> = manifest.images.iter().map(|i| i.name.as_str()).collect();
            assert_eq!(names.len(), manifest.images.len(), "two images share a name");
            assert!(!manifest.platforms.is_empty());
            for image in &manifest.images {
                match &image.spec {
                    ImageSpec::Pinned(r) => assert!(r.digest().is_some(), "pinned {} has no digest", image.name),
                    ImageSpec::Built(built) => assert!(built.context.is_absolute() && built.context.is_dir()),
                    ImageSpec::Brought(_) => {}
                }
            }
        }
        Err(err) => {
            let shown = err.to_string();
            assert!(shown.starts_with(&path.display().to_string()), "{shown}");
            match err.line {
                Some(line) => {
                    let lines = text.split('\n').count();
                    assert!((1..=lines).contains(&line), "line {line} of a {lines}-line file: {shown}");
                    assert!(shown.contains(&format!(":{line}: ")), "{shown}");
                }
                None => assert!(
                    matches!(*err.problem, Problem::MissingInstance | Problem::NoTarget | Problem::NoImages),
                    "an error that names no line: {shown}"
                ),
            }
        }
    }
});
