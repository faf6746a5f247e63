//! `kiln watch`: a per-user process that watches the contexts `kiln` has walked (inotify) so that
//! a walk of a tree that has not changed can be skipped.
//!
//! It answers one question — *what is the tag of this context now?* — over a Unix socket only
//! its user can reach. A tag changes whenever anything under the context changes (a write, a
//! create, a rename, a delete, a mode, owner or time change) and never otherwise. `kiln` asks
//! before it walks and keeps the walk's result beside the context's stat cache under the tag it
//! got (`kiln_core::digest::digest_dir_vouched`); the next time the same tag comes back, that result
//! is the digest and nothing is walked. So a no-op `kiln up` costs one round trip per context
//! instead of an `lstat` per file.
//!
//! The answer is exact because the watcher reads every event the kernel has queued before it
//! answers, and the kernel queues an event inside the syscall that made the change: a change
//! that finished before `kiln` asked is in the answer. What inotify does not report, Kiln cannot
//! see either, so those cases are named (README): writes through a shared `mmap`, and writes
//! through a hard link made from outside the context after it was walked (a tree that already
//! has hard links when walked is never vouched for); on a filesystem inotify does not cover
//! (network filesystems, FUSE) the watcher refuses the context and `kiln` walks it.
//! `KILN_WATCH=off` makes `kiln` walk whatever the watcher says.
//!
//! Anything that goes wrong on the way — no watcher, an old one, a slow one, a refused context —
//! means a walk, the way `kiln` works without a watcher; never a wrong digest.

mod daemon;
mod protocol;

pub use daemon::{serve, Context, Watcher, WatcherHandle};

use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long `kiln` waits for the watcher's answer before walking without it.
const ANSWER_WAIT: Duration = Duration::from_secs(2);

/// The watcher's socket: `$KILN_WATCH_SOCKET`, else `kiln/watch.sock` under `$XDG_RUNTIME_DIR`
/// (a folder only its user can enter), else under the user's cache folder.
pub fn socket_path() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(path) = var("KILN_WATCH_SOCKET") {
        return Some(path);
    }
    let base =
        var("XDG_RUNTIME_DIR").or_else(|| var("XDG_CACHE_HOME")).or_else(|| var("HOME").map(|h| h.join(".cache")))?;
    Some(base.join("kiln").join("watch.sock"))
}

/// Whether `kiln` asks the watcher at all (`KILN_WATCH=off` says no).
fn enabled() -> bool {
    !matches!(std::env::var("KILN_WATCH").as_deref(), Ok("off" | "0" | "false" | "no"))
}

/// The watcher's tag of each context (a canonical path and the Dockerfile its walk keeps), or
/// `None` for one it cannot watch. `None` as a whole when no watcher runs or it could not answer;
/// that is said on stderr unless simply nobody runs one.
pub fn tags(roots: &[Context]) -> Option<Vec<Option<Vec<u8>>>> {
    if roots.is_empty() || !enabled() {
        return None;
    }
    let socket = socket_path()?;
    match ask(&socket, roots) {
        Ok(answers) => Some(answers.into_iter().map(Result::ok).collect()),
        Err(err) if matches!(err.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused) => None,
        Err(err) => {
            eprintln!("kiln: the watcher at {} did not answer ({err}); walking every context", socket.display());
            None
        }
    }
}

/// One question to the watcher at `socket`, bounded by [`ANSWER_WAIT`]: each root's tag, or why
/// it cannot be watched.
pub fn ask(socket: &Path, roots: &[Context]) -> io::Result<Vec<Result<Vec<u8>, String>>> {
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(ANSWER_WAIT))?;
    stream.set_write_timeout(Some(ANSWER_WAIT))?;
    protocol::write_question(&mut stream, roots)?;
    protocol::read_answers(&mut stream, roots.len())
}

/// `kiln watch`: answers on `socket` (default [`socket_path`]) until SIGINT or SIGTERM.
pub fn run(socket: Option<PathBuf>) -> anyhow::Result<()> {
    use anyhow::Context;
    let socket = socket
        .or_else(socket_path)
        .context("no place for the watcher's socket: set KILN_WATCH_SOCKET, XDG_RUNTIME_DIR or HOME")?;
    let handle = serve(&socket).with_context(|| format!("cannot start the watcher on {}", socket.display()))?;
    eprintln!(
        "kiln watch: answering on {} — kiln up and kiln digest skip the walk of every context \
         that has not changed since they last walked it; stop with Ctrl-C",
        socket.display()
    );
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            stopped = tokio::signal::ctrl_c() => stopped,
            _ = term.recv() => Ok(()),
        }
    })?;
    handle.stop();
    let (roots, dirs) = handle.watcher.counts();
    eprintln!("kiln watch: stopped ({roots} contexts, {dirs} directories were watched)");
    Ok(())
}
