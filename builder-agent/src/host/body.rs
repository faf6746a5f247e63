//! The body of a build request: the verified context archive, streamed from disk, plus — when the
//! Dockerfile lives outside the context — the two entries that carry it without letting the build
//! see it.
//!
//! The archive's entries go out byte for byte as verified; only its end-of-archive blocks are
//! replaced. A Dockerfile kept outside the context is appended as [`OUTSIDE_DOCKERFILE`], and a
//! `.dockerignore` naming it is appended after the context's own (a later tar entry replaces an
//! earlier one when Docker extracts the context). The daemon deletes the Dockerfile and the
//! `.dockerignore` from the context when the `.dockerignore` names them, so `COPY . /` sees the
//! context and not Kiln's addition — the same device `docker build -f ../Dockerfile` uses. When the
//! context has no `.dockerignore`, the appended one names itself too and vanishes whole. When it has
//! one that does not name itself, the build sees that file with one extra line, as with Docker's CLI.
//!
//! Memory stays bounded whatever the context's size: the archive is read in fixed chunks as the
//! daemon takes them, and finding its end only reads headers (the tar reader seeks over contents).

use super::copies::never_copies;
use super::HostError;
use bytes::{Bytes, BytesMut};
use futures_util::stream::{self, Stream, StreamExt};
use kiln_core::ignore::DockerIgnore;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use tokio::io::AsyncReadExt;

/// The name under which a Dockerfile kept outside the context travels to Docker.
pub const OUTSIDE_DOCKERFILE: &str = ".kiln-dockerfile";
const IGNORE_FILE: &str = ".dockerignore";
const BLOCK: u64 = 512;
const CHUNK: usize = 256 * 1024;

/// A build request's body, ready to stream: the archive's first `entries_end` bytes, then `tail`.
#[derive(Debug)]
pub(super) struct BuildBody {
    archive: PathBuf,
    file: File,
    entries_end: u64,
    tail: Vec<u8>,
    /// The Dockerfile path to name in the request.
    pub(super) dockerfile: String,
    /// Whether a BuildKit build would produce what the classic builder does. BuildKit applies no
    /// `.dockerignore` to a context sent as the request body, and the archive already leaves out
    /// what it ignores — except the Dockerfile and `.dockerignore`, which always travel, and, for a
    /// Dockerfile from outside, the appended file and `.dockerignore` hiding it. So the two agree
    /// when there is no such extra file, or when no `COPY`/`ADD` can reach one (`copies`).
    pub(super) buildkit_sees_the_same: bool,
}

impl BuildBody {
    /// Opens `archive` and, for a Dockerfile outside the context, finds where its entries end and
    /// builds the entries to append. Blocking: it reads the archive's headers.
    pub(super) fn prepare(archive: &Path, dockerfile: &str, outside: Option<&[u8]>) -> Result<BuildBody, HostError> {
        let unreadable = |source| HostError::ContextUnreadable { archive: archive.to_path_buf(), source };
        let file = File::open(archive).map_err(unreadable)?;
        let Some(outside) = outside else {
            let entries_end = file.metadata().map_err(unreadable)?.len();
            let scan = scan(archive, false, Some(dockerfile))?;
            let own = match scan.ignore.map(String::from_utf8) {
                None => Some(DockerIgnore::empty()),
                Some(Ok(text)) => DockerIgnore::parse(&text).ok(),
                Some(Err(_)) => None,
            };
            // What BuildKit would show a `COPY` that the classic builder hides: the Dockerfile and
            // `.dockerignore` when `.dockerignore` names them (as their top-level entries).
            let buildkit_sees_the_same = own.is_some_and(|own| {
                let top = dockerfile.split('/').next().unwrap_or(dockerfile);
                let extras: Vec<&str> = [(dockerfile, top), (IGNORE_FILE, IGNORE_FILE)]
                    .into_iter()
                    .filter(|(path, _)| own.is_excluded(path))
                    .map(|(_, top)| top)
                    .collect();
                let text = scan.dockerfile.as_deref().and_then(|b| std::str::from_utf8(b).ok());
                extras.is_empty() || text.is_some_and(|text| never_copies(text, &extras))
            });
            return Ok(BuildBody {
                archive: archive.to_path_buf(),
                file,
                entries_end,
                tail: Vec::new(),
                dockerfile: dockerfile.to_string(),
                buildkit_sees_the_same,
            });
        };
        let scan = scan(archive, true, None)?;
        // BuildKit would show a `COPY` the appended Dockerfile, the appended `.dockerignore`, and a
        // context `Dockerfile` that `.dockerignore` hides from the classic builder.
        let buildkit_sees_the_same = std::str::from_utf8(outside)
            .is_ok_and(|text| never_copies(text, &[OUTSIDE_DOCKERFILE, IGNORE_FILE, "Dockerfile"]));
        let ignore = match scan.ignore {
            Some(mut own) => {
                if !own.is_empty() && !own.ends_with(b"\n") {
                    own.push(b'\n');
                }
                own.extend_from_slice(format!("{OUTSIDE_DOCKERFILE}\n").as_bytes());
                own
            }
            None => format!("{IGNORE_FILE}\n{OUTSIDE_DOCKERFILE}\n").into_bytes(),
        };
        let mut tail = Vec::with_capacity(outside.len() + ignore.len() + 6 * BLOCK as usize);
        append_file(&mut tail, OUTSIDE_DOCKERFILE, outside).map_err(unreadable)?;
        append_file(&mut tail, IGNORE_FILE, &ignore).map_err(unreadable)?;
        tail.extend_from_slice(&[0u8; 2 * BLOCK as usize]);
        Ok(BuildBody {
            archive: archive.to_path_buf(),
            file,
            entries_end: scan.entries_end,
            tail,
            dockerfile: OUTSIDE_DOCKERFILE.to_string(),
            buildkit_sees_the_same,
        })
    }

    /// The body's length in bytes, for a request's `Content-Length`.
    pub(super) fn len(&self) -> u64 {
        self.entries_end + self.tail.len() as u64
    }

    /// The body as a stream of chunks, read from disk as it is consumed. A file that turns out
    /// shorter than it was when prepared ends the stream with an error rather than a truncated tar.
    pub(super) fn into_stream(self) -> impl Stream<Item = io::Result<Bytes>> + Send + 'static {
        let reader = tokio::fs::File::from_std(self.file).take(self.entries_end);
        let archive = self.archive;
        let head = stream::unfold(Some(reader), move |state| {
            let archive = archive.clone();
            async move {
                let mut reader = state?;
                let mut buf = BytesMut::with_capacity(CHUNK);
                match reader.read_buf(&mut buf).await {
                    Ok(0) if reader.limit() == 0 => None,
                    Ok(0) => {
                        let why = format!("context archive {} shrank while it was being sent", archive.display());
                        Some((Err(io::Error::new(io::ErrorKind::UnexpectedEof, why)), None))
                    }
                    Ok(_) => Some((Ok(buf.freeze()), Some(reader))),
                    Err(err) => Some((Err(err), None)),
                }
            }
        });
        let tail = (!self.tail.is_empty()).then(|| Ok(Bytes::from(self.tail)));
        head.chain(stream::iter(tail))
    }
}

struct Scan {
    entries_end: u64,
    ignore: Option<Vec<u8>>,
    /// The bytes of the file asked for, when it is a regular file of at most [`DOCKERFILE_LIMIT`].
    dockerfile: Option<Vec<u8>>,
}

/// A Dockerfile larger than this is not read for the BuildKit decision: it builds classic.
const DOCKERFILE_LIMIT: u64 = 1 << 20;

/// Reads the archive's headers (seeking over contents) for where its last entry ends, the
/// context's own `.dockerignore`, the file at `dockerfile` when given, and (with `reserve`) a clash
/// with the reserved name.
fn scan(archive: &Path, reserve: bool, dockerfile: Option<&str>) -> Result<Scan, HostError> {
    let unreadable = |source| HostError::ContextUnreadable { archive: archive.to_path_buf(), source };
    let mut reader = tar::Archive::new(File::open(archive).map_err(unreadable)?);
    let mut out = Scan { entries_end: 0, ignore: None, dockerfile: None };
    for entry in reader.entries_with_seek().map_err(unreadable)? {
        let mut entry = entry.map_err(unreadable)?;
        let raw = entry.path_bytes();
        let path = raw.strip_suffix(b"/").unwrap_or(&raw);
        if reserve && path == OUTSIDE_DOCKERFILE.as_bytes() {
            return Err(HostError::ReservedName { archive: archive.to_path_buf(), name: OUTSIDE_DOCKERFILE });
        }
        if path == IGNORE_FILE.as_bytes() {
            if !entry.header().entry_type().is_file() {
                return Err(HostError::IgnoreNotAFile { archive: archive.to_path_buf() });
            }
            let mut own = Vec::new();
            entry.read_to_end(&mut own).map_err(unreadable)?;
            out.ignore = Some(own);
        } else if dockerfile.is_some_and(|d| path == d.as_bytes())
            && entry.header().entry_type().is_file()
            && entry.size() <= DOCKERFILE_LIMIT
        {
            let mut text = Vec::new();
            entry.read_to_end(&mut text).map_err(unreadable)?;
            out.dockerfile = Some(text);
        }
        out.entries_end = entry.raw_file_position() + entry.size().div_ceil(BLOCK) * BLOCK;
    }
    Ok(out)
}

/// Appends one regular file to a tar stream, stamped like the canonical archive's entries.
fn append_file(out: &mut Vec<u8>, name: &str, contents: &[u8]) -> io::Result<()> {
    let mut header = tar::Header::new_ustar();
    header.set_path(name)?;
    header.set_entry_type(tar::EntryType::Regular);
    header.set_size(contents.len() as u64);
    header.set_mode(0o644);
    header.set_mtime(0);
    header.set_uid(0);
    header.set_gid(0);
    header.set_cksum();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(contents);
    let padding = (contents.len() as u64).div_ceil(BLOCK) * BLOCK - contents.len() as u64;
    out.extend(std::iter::repeat_n(0u8, padding as usize));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::TryStreamExt;
    use kiln_core::archive::pack;
    use kiln_core::digest::{digest_dir, WalkOptions};

    fn packed(files: &[(&str, &str)]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let ctx = dir.path().join("ctx");
        std::fs::create_dir(&ctx).unwrap();
        for (name, body) in files {
            std::fs::write(ctx.join(name), body).unwrap();
        }
        let (tree, _) = digest_dir(&ctx, &WalkOptions::default()).unwrap();
        let path = dir.path().join("ctx.tar");
        pack(&tree, File::create(&path).unwrap()).unwrap();
        (dir, path)
    }

    async fn sent(body: BuildBody) -> Vec<u8> {
        let chunks: Vec<Bytes> = body.into_stream().try_collect().await.unwrap();
        chunks.concat()
    }

    fn entries(tar_bytes: &[u8]) -> Vec<(String, String)> {
        let mut archive = tar::Archive::new(tar_bytes);
        archive
            .entries()
            .unwrap()
            .map(|entry| {
                let mut entry = entry.unwrap();
                let path = String::from_utf8(entry.path_bytes().into_owned()).unwrap();
                let mut body = String::new();
                entry.read_to_string(&mut body).unwrap();
                (path, body)
            })
            .collect()
    }

    #[tokio::test]
    async fn an_inside_dockerfile_sends_the_archive_unchanged() {
        let (_dir, path) = packed(&[("Dockerfile", "FROM scratch\n"), ("a", "x")]);
        let body = BuildBody::prepare(&path, "Dockerfile", None).unwrap();
        assert_eq!(body.dockerfile, "Dockerfile");
        assert_eq!(sent(body).await, std::fs::read(&path).unwrap());
    }

    #[tokio::test]
    async fn an_outside_dockerfile_is_appended_and_ignored_with_a_new_dockerignore() {
        let (_dir, path) = packed(&[("a", "x")]);
        let body = BuildBody::prepare(&path, "Dockerfile", Some(b"FROM scratch\nCOPY a /\n")).unwrap();
        assert_eq!(body.dockerfile, OUTSIDE_DOCKERFILE);
        let got = entries(&sent(body).await);
        let want = [
            ("a", "x"),
            (OUTSIDE_DOCKERFILE, "FROM scratch\nCOPY a /\n"),
            (IGNORE_FILE, ".dockerignore\n.kiln-dockerfile\n"),
        ];
        assert_eq!(got, want.map(|(p, b)| (p.to_string(), b.to_string())));
    }

    #[tokio::test]
    async fn an_outside_dockerfile_extends_the_contexts_own_dockerignore_after_it() {
        let (_dir, path) = packed(&[(".dockerignore", "*.log"), ("a", "x")]);
        let got = entries(&sent(BuildBody::prepare(&path, "Dockerfile", Some(b"FROM scratch\n")).unwrap()).await);
        let names: Vec<&str> = got.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(names, [IGNORE_FILE, "a", OUTSIDE_DOCKERFILE, IGNORE_FILE]);
        assert_eq!(got[0].1, "*.log");
        assert_eq!(got[3].1, "*.log\n.kiln-dockerfile\n");
    }

    #[test]
    fn a_context_holding_the_reserved_name_is_refused() {
        let (_dir, path) = packed(&[(OUTSIDE_DOCKERFILE, "mine"), ("a", "x")]);
        let err = BuildBody::prepare(&path, "Dockerfile", Some(b"FROM scratch\n")).unwrap_err();
        assert!(matches!(err, HostError::ReservedName { .. }), "{err:?}");
    }
}
