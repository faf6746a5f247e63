//! Which foreign platforms this host runs through emulation: the binfmt_misc handlers registered
//! in the kernel (`qemu-user-static`, or `tonistiigi/binfmt`), read from
//! `/proc/sys/fs/binfmt_misc` or the root an agent is configured with (so tests read a tree they
//! laid out). The agent announces them in its hello; the coordinator places a build with `RUN`
//! steps for a platform here only when no agent builds it natively, and refuses the converge
//! before any build when no agent runs it at all — a RUN on a platform nobody runs would
//! otherwise fail halfway with `exec format error`.
//!
//! A handler counts when its file says `enabled` and binfmt_misc as a whole is enabled (its
//! `status` file, when present, says so). The architecture is read from the handler's name, as
//! qemu's and binfmt's installers name them (`qemu-aarch64`, `qemu-arm`, `qemu-riscv64`).

use std::path::Path;

/// Where the kernel shows binfmt_misc when it is mounted.
pub const BINFMT_ROOT: &str = "/proc/sys/fs/binfmt_misc";

/// The platforms (OCI form, `linux/arm64`) that registered handlers under `root` run, sorted,
/// without the host's own ones (`native`). An absent or unreadable root emulates nothing.
pub fn emulated_platforms(root: &Path, native: &[String]) -> Vec<String> {
    if let Ok(status) = std::fs::read_to_string(root.join("status")) {
        if status.trim() != "enabled" {
            return Vec::new();
        }
    }
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    let mut found: Vec<String> = entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().to_string();
            let arch = name.strip_prefix("qemu-")?;
            let text = std::fs::read_to_string(entry.path()).ok()?;
            (text.lines().next()? == "enabled").then_some(())?;
            platforms_of(arch)
        })
        .flatten()
        .filter(|p| !native.contains(p))
        .collect();
    found.sort();
    found.dedup();
    found
}

/// The platforms a qemu handler named `qemu-<arch>` runs.
fn platforms_of(qemu_arch: &str) -> Option<Vec<String>> {
    let oci: &[&str] = match qemu_arch {
        "aarch64" => &["linux/arm64"],
        "arm" => &["linux/arm/v7", "linux/arm/v6"],
        "x86_64" => &["linux/amd64"],
        "i386" => &["linux/386"],
        "riscv64" => &["linux/riscv64"],
        "ppc64le" => &["linux/ppc64le"],
        "s390x" => &["linux/s390x"],
        "mips64el" => &["linux/mips64le"],
        "loongarch64" => &["linux/loong64"],
        _ => return None,
    };
    let canonical = oci.iter().filter_map(|p| kiln_core::refs::Platform::parse(p).ok()).map(|p| p.oci()).collect();
    Some(canonical)
}

#[cfg(test)]
mod tests {
    use super::*;

    const AARCH64: &str = "enabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\nflags: POCF\noffset 0\n\
         magic 7f454c460201010000000000000000000200b700\n";

    fn root(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        dir
    }

    #[test]
    fn an_enabled_handler_is_an_emulated_platform_and_a_disabled_one_is_not() {
        let native = vec!["linux/amd64".to_string()];
        let dir = root(&[
            ("status", "enabled\n"),
            ("register", ""),
            ("qemu-aarch64", AARCH64),
            ("qemu-riscv64", "disabled\ninterpreter /usr/bin/qemu-riscv64\n"),
            ("qemu-x86_64", "enabled\n"),
            ("python3.11", "enabled\n"),
        ]);
        assert_eq!(emulated_platforms(dir.path(), &native), vec!["linux/arm64"]);
    }

    #[test]
    fn binfmt_disabled_or_absent_emulates_nothing() {
        let dir = root(&[("status", "disabled\n"), ("qemu-aarch64", AARCH64)]);
        assert!(emulated_platforms(dir.path(), &[]).is_empty());
        assert!(emulated_platforms(&dir.path().join("not-mounted"), &[]).is_empty());
    }
}
