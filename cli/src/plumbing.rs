//! The plumbing commands: thin wrappers over `kiln-core` that print what they computed.

use anyhow::{bail, Context, Result};
use kiln_core::archive;
use kiln_core::digest::{cache_file_for, digest_dir, digest_dir_cached, digest_dir_vouched, TreeDigest, WalkOptions};
use kiln_core::manifest::{ImageSpec, Manifest, PlatformSource};
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

/// A plumbing command's input is the user's: a directory that is not there, a manifest or a
/// digest that does not parse is a usage error (exit 2), as it is for `kiln up`.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(String);

/// The exit code of a plumbing failure: 2 for what the user gave, 1 for the rest.
pub fn exit_of(err: &anyhow::Error) -> crate::Exit {
    if let Some(cli) = err.chain().find_map(|e| e.downcast_ref::<crate::CliError>()) {
        return cli.exit();
    }
    let usage = err.chain().any(|e| {
        e.is::<Usage>()
            || e.is::<kiln_core::manifest::ManifestError>()
            || e.is::<kiln_core::manifest::AddressError>()
            || e.is::<kiln_core::digest::DigestParseError>()
    });
    if usage {
        crate::Exit::Usage
    } else {
        crate::Exit::Failed
    }
}

/// True when the failure is only that whoever read stdout stopped (`| head`).
pub fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|e| e.downcast_ref::<io::Error>().is_some_and(|io| io.kind() == io::ErrorKind::BrokenPipe))
}

/// Refuses a context path that is not a directory, naming it (the walk would name it `.`).
fn context_dir(dir: &Path) -> Result<()> {
    match std::fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(_) => Err(Usage(format!("{} is not a directory — give a build context directory", dir.display())).into()),
        Err(err) => Err(Usage(format!("cannot read context directory {}: {err}", dir.display())).into()),
    }
}

/// `kiln digest [--list] DIR`. With `stat_cache` (a directory), files whose stat has not moved
/// since the last digest are not read again.
pub fn digest(dir: &Path, list: bool, dockerfile: String, stat_cache: Option<&Path>) -> Result<()> {
    context_dir(dir)?;
    let opts = WalkOptions { dockerfile: Some(dockerfile) };
    if let (Some(cache), false) = (stat_cache, list) {
        // Without the list, a context `kiln watch` vouches for is not walked at all.
        let tag = std::fs::canonicalize(dir)
            .ok()
            .and_then(|root| crate::watch::tags(&[(root, opts.dockerfile.clone())]))
            .and_then(|mut t| t.pop());
        let (_, summary) =
            digest_dir_vouched(dir, &opts, &cache_file_for(cache, dir), tag.as_ref().and_then(|t| t.as_deref()))?;
        writeln!(io::stdout().lock(), "{}", summary.digest)?;
        return Ok(());
    }
    let (tree, digest) = match stat_cache {
        Some(cache) => {
            let (tree, hashed, _) = digest_dir_cached(dir, &opts, &cache_file_for(cache, dir))?;
            (tree, hashed.digest)
        }
        None => digest_dir(dir, &opts)?,
    };
    let mut out = BufWriter::new(io::stdout().lock());
    if list {
        for e in &tree.entries {
            let path = String::from_utf8_lossy(&e.path);
            // A file's hash is what `b3sum` prints for it: the tree digest covers it, not the bytes.
            let hash = e.hash.map_or_else(|| format!("{:<64}", "-"), |h| h.to_string());
            match e.kind {
                kiln_core::digest::EntryKind::Symlink => writeln!(
                    out,
                    "{:<7} {:>12}  {hash}  {path} -> {}",
                    e.kind.name(),
                    e.size,
                    String::from_utf8_lossy(&e.link_target)
                )?,
                _ => writeln!(out, "{:<7} {:>12}  {hash}  {path}", e.kind.name(), e.size)?,
            }
        }
        writeln!(out, "{} entries", tree.entries.len())?;
    }
    writeln!(out, "{digest}")?;
    out.flush()?;
    Ok(())
}

pub fn pack(dir: &Path, output: &Path, dockerfile: String) -> Result<()> {
    context_dir(dir)?;
    let (tree, digest) = digest_dir(dir, &WalkOptions { dockerfile: Some(dockerfile) })?;
    let packed = if output == Path::new("-") {
        archive::pack(&tree, BufWriter::new(io::stdout().lock()))?
    } else {
        let file = File::create(output).with_context(|| format!("cannot create {}", output.display()))?;
        archive::pack(&tree, BufWriter::with_capacity(1 << 20, file))?
    };
    if packed.digest != digest {
        bail!(
            "context {} changed while it was packed (digest {digest} when walked, {} when packed) — re-run once it is quiet",
            dir.display(),
            packed.digest
        );
    }
    eprintln!("packed {} entries, {} bytes, tree {}", tree.entries.len(), packed.bytes, packed.digest);
    Ok(())
}

pub fn unpack(file: &Path, dir: &Path, expect: Option<&str>) -> Result<()> {
    let expected: Option<TreeDigest> = expect.map(str::parse).transpose()?;
    let existed = dir.exists();
    let result = if file == Path::new("-") {
        archive::unpack(io::stdin().lock(), dir, expected.as_ref())
    } else {
        let input = File::open(file).with_context(|| format!("cannot open archive {}", file.display()))?;
        archive::unpack(io::BufReader::with_capacity(1 << 20, input), dir, expected.as_ref())
    };
    match result {
        Ok(done) => {
            eprintln!(
                "unpacked {} entries ({} bytes of content) into {}",
                done.entries,
                done.content_bytes,
                dir.display()
            );
            println!("{}", done.digest);
            Ok(())
        }
        Err(err) => {
            // What a refused archive left is discarded: the directory was empty (or new) before.
            if existed {
                clear_dir(dir)?;
            } else {
                let _ = std::fs::remove_dir_all(dir);
            }
            Err(err).with_context(|| format!("unpacking {} — {} left empty", file.display(), dir.display()))
        }
    }
}

fn clear_dir(dir: &Path) -> Result<()> {
    for item in std::fs::read_dir(dir)? {
        let path = item?.path();
        if path.symlink_metadata()?.is_dir() {
            std::fs::remove_dir_all(&path)?;
        } else {
            std::fs::remove_file(&path)?;
        }
    }
    Ok(())
}

/// Step 1 of the converge, alone: stage, walk and address every built image exactly as `kiln up`
/// does (`request::walk_built`), so a staged image's ref here is the one `up` builds; brought and
/// pinned refs pass through untouched, but for a pinned image a `mirror_registry` re-homes.
///
/// A platform set that comes from the target's cluster is asked of the coordinator `connect`
/// names (or an embedded one), exactly as `kiln up` asks it.
pub fn refs(dir: &Path, connect: &crate::Connect) -> Result<()> {
    let mut manifest = Manifest::load(dir)?;
    if matches!(manifest.platform_source, PlatformSource::Cluster { .. }) {
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
        let asking = crate::embedded::with_coordinator(connect, true, |link| async move {
            crate::platforms::from_cluster(&link, manifest).await
        });
        manifest = runtime.block_on(asking)?;
    }
    let mut out = BufWriter::new(io::stdout().lock());
    writeln!(out, "instance {} → {} ({})", manifest.instance, manifest.target.kind_name(), manifest.platforms)?;
    let walked = crate::request::walk_built(&manifest, None)?;
    let addressed = manifest.address(&walked.trees()).with_context(|| manifest.path.display().to_string())?;
    for image in &manifest.images {
        match &image.spec {
            ImageSpec::Built(_) => {
                let done = addressed.iter().find(|a| a.name == image.name).expect("every built image is addressed");
                let entries = walked.contexts[&image.name].entries;
                let staged = if walked.staged.contains_key(&image.name) { ", staged" } else { "" };
                writeln!(out, "{:<12} built    {}  ({entries} entries{staged})", image.name, done.reference)?;
            }
            ImageSpec::Brought(r) => writeln!(out, "{:<12} brought  {r}", image.name)?,
            // Re-homed by `mirror_registry`, a pinned image is deployed from the mirror: the ref
            // the record and the ConfigMap will name, computed as the coordinator computes it.
            ImageSpec::Pinned(r) => match &manifest.mirror_registry {
                Some(mirror) => {
                    let mirrored = kiln_core::refs::mirrored(r, &mirror.to_string())?;
                    writeln!(out, "{:<12} pinned   {mirrored}  (mirror of {r})", image.name)?
                }
                None => writeln!(out, "{:<12} pinned   {r}", image.name)?,
            },
        }
    }
    out.flush()?;
    Ok(())
}
