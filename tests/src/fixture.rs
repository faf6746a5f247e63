//! Instance folders for tests: private copies of the examples, or small instances written on the
//! spot, each with a unique instance name so tests never share tags on the daemon.

use std::path::{Path, PathBuf};

pub fn unique(prefix: &str) -> String {
    format!("{prefix}{:08x}", fastrand::u32(..))
}

pub fn write(dir: &Path, rel: &str, content: &str) {
    let path = dir.join(rel);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, content).unwrap();
}

pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dest = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &dest);
        } else {
            std::fs::copy(entry.path(), &dest).unwrap();
        }
    }
}

/// A private copy of `examples/<name>` under `into/<folder>`, its instance renamed to `instance`
/// and, when given, its registry address replaced.
pub fn example(name: &str, into: &Path, folder: &str, instance: &str, registry: Option<&str>) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples").join(name);
    let dir = into.join(folder);
    copy_dir(&src, &dir);
    let manifest = dir.join("kiln.toml");
    let mut text = std::fs::read_to_string(&manifest).unwrap();
    let start = text.find("instance = \"").unwrap() + "instance = \"".len();
    let end = start + text[start..].find('"').unwrap();
    text.replace_range(start..end, instance);
    if let Some(registry) = registry {
        text = text.replace("127.0.0.1:5000", registry);
    }
    std::fs::write(&manifest, text).unwrap();
    dir
}

/// Removes every built image's content tag of the instance folder `dir` from the daemon.
pub fn remove_built(dir: &Path) {
    let (req, _) = crate::wire::up_request(dir, false);
    for image in req.images.iter().filter(|i| !i.context_digest.is_empty()) {
        crate::docker::remove(&image.reference);
    }
}

/// The content ref `kiln up` computes for image `name` of the instance folder `dir`.
pub fn reference(dir: &Path, name: &str) -> String {
    let (req, _) = crate::wire::up_request(dir, false);
    req.images.into_iter().find(|i| i.name == name).unwrap().reference
}
