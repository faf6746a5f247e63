//! Conformance vectors of the tree digest: small trees that exercise every corner of the spec
//! (empty directories, symlinks, executable bits, non-UTF-8 names, `.dockerignore`, long names, a
//! file big enough for the parallel path), each with its pinned v2 digest.
//!
//! They live beside the spec rather than in one crate's tests because every implementation of it
//! must agree on them: `core`'s tests check the walk and an independent encoding against the
//! pinned digests, the agent's tests check its archive verification, the CLI's tests check
//! `kiln digest`. A change to any pinned digest is a change of the spec.

use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;

/// One vector: a tree and the digest every implementation must compute for it.
#[derive(Clone, Copy, Debug)]
pub struct Vector {
    pub name: &'static str,
    /// The v2 tree digest, as `kiln digest` prints it.
    pub digest: &'static str,
    /// Writes the tree into an empty directory.
    pub build: fn(&Path) -> io::Result<()>,
}

pub const VECTORS: &[Vector] = &[
    Vector { name: "empty", digest: "46d4677d4d5b4613772f57bb0ef5a1632ab8cf7428efda6923a5bd08ef5e7478", build: empty },
    Vector {
        name: "empty-dirs",
        digest: "76a6ba65bd9781793856169a42296c70ddcc5ad155e502ff5396f953750eab0e",
        build: empty_dirs,
    },
    Vector { name: "files", digest: "3831f58af0086e9dbe5a55c16082916b164a13096ca729caf2d7940ca7e61653", build: files },
    Vector {
        name: "exec-bits",
        digest: "386ee65e3a496148a5e824e32204908bf3ab4791bb2c5ba1f73d652d1c5ecac4",
        build: exec_bits,
    },
    Vector {
        name: "symlinks",
        digest: "766a5de5f51e13d2b4c9c0090bd8e0ec1799654cf2eb685d4f7b963132239d9e",
        build: symlinks,
    },
    Vector {
        name: "non-utf8-names",
        digest: "58c0e84db10aac00df49eae7943dc792e720b5568d8faba3e2381c77ec50bee0",
        build: non_utf8_names,
    },
    Vector {
        name: "ignored",
        digest: "b3406dc83e36338a892006f53552917701a8a2fc0670e41a82eb896d9646b219",
        build: ignored,
    },
    Vector {
        name: "long-names",
        digest: "79748e2df80ac68a773df866321cbdd2c1eb232251864c1eb02b60cf0c1964e9",
        build: long_names,
    },
    Vector {
        name: "big-file",
        digest: "bc8a2cdca0185107b7cc767351a2790e155bf0d609b4dd35f254d3c5cb41fbe1",
        build: big_file,
    },
];

fn write(root: &Path, rel: &[u8], content: &[u8], mode: u32) -> io::Result<()> {
    let path = root.join(std::ffi::OsStr::from_bytes(rel));
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)?;
    }
    fs::write(&path, content)?;
    fs::set_permissions(&path, fs::Permissions::from_mode(mode))
}

fn mkdir(root: &Path, rel: &str) -> io::Result<()> {
    fs::create_dir_all(root.join(rel))
}

fn empty(_: &Path) -> io::Result<()> {
    Ok(())
}

fn empty_dirs(r: &Path) -> io::Result<()> {
    mkdir(r, "a/b/c")?;
    mkdir(r, "a/d")?;
    mkdir(r, "e")?;
    write(r, b"a/b/f", b"", 0o644)
}

fn files(r: &Path) -> io::Result<()> {
    write(r, b"Dockerfile", b"FROM scratch\nCOPY . /\n", 0o644)?;
    write(r, b"empty", b"", 0o644)?;
    // Exactly 32 bytes: under v1 this content was indistinguishable from a 32-byte hash.
    write(r, b"thirty-two", b"0123456789abcdef0123456789abcdef", 0o644)?;
    write(r, b"src/main.rs", b"fn main() {}\n", 0o644)
}

fn exec_bits(r: &Path) -> io::Result<()> {
    write(r, b"run.sh", b"#!/bin/sh\n", 0o755)?;
    write(r, b"owner-only-x", b"#!/bin/sh\n", 0o700)?;
    write(r, b"group-x", b"#!/bin/sh\n", 0o654)?;
    write(r, b"plain", b"#!/bin/sh\n", 0o644)?;
    write(r, b"private", b"#!/bin/sh\n", 0o600)
}

fn symlinks(r: &Path) -> io::Result<()> {
    write(r, b"d/f", b"target", 0o644)?;
    symlink("d/f", r.join("to-file"))?;
    symlink("d", r.join("to-dir"))?;
    symlink("../d/f", r.join("d/up-and-over"))?;
    symlink("./f", r.join("d/dot"))?;
    symlink("missing", r.join("dangling"))
}

fn non_utf8_names(r: &Path) -> io::Result<()> {
    write(r, b"caf\xe9", b"latin-1", 0o644)?;
    write(r, b"\xff\xfe/inner", b"bytes", 0o644)?;
    // Byte order, not locale order: `B` < `a` < `a-b` < `a.txt` < `a/b`.
    write(r, b"B", b"1", 0o644)?;
    write(r, b"a-b", b"2", 0o644)?;
    write(r, b"a.txt", b"3", 0o644)?;
    write(r, b"a/b", b"4", 0o644)?;
    write(r, "\u{e9}t\u{e9}".as_bytes(), b"utf-8", 0o644)
}

fn ignored(r: &Path) -> io::Result<()> {
    write(r, b".dockerignore", b"*.log\nbuild\n!build/keep.txt\nDockerfile\n", 0o644)?;
    write(r, b"Dockerfile", b"FROM scratch\n", 0o644)?;
    write(r, b"app.log", b"noise", 0o644)?;
    write(r, b"src/deep.log", b"kept: *.log matches the root only", 0o644)?;
    write(r, b"build/out.o", b"ignored", 0o644)?;
    write(r, b"build/keep.txt", b"excepted", 0o644)?;
    write(r, b"src/a.rs", b"a", 0o644)
}

fn long_names(r: &Path) -> io::Result<()> {
    let dir = "d".repeat(90);
    let name = "n".repeat(120);
    write(r, format!("{dir}/{name}").as_bytes(), b"ustar cannot hold this path", 0o644)?;
    symlink(format!("{dir}/{name}"), r.join("l".repeat(110)))
}

fn big_file(r: &Path) -> io::Result<()> {
    // Past 1 MiB: hashed through the memory map and blake3's parallel path.
    let content: Vec<u8> = (0..(1u32 << 20) + 4099).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    write(r, b"big.bin", &content, 0o755)?;
    write(r, b"small", b"s", 0o644)
}
