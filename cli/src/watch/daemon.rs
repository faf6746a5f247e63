//! The watcher itself: one inotify instance, a watch on every directory *and every file* of every
//! context it has been asked about, and a generation per context that moves with every event
//! under it.
//!
//! Files are watched as well as their directories because a directory's watch reports only what
//! is done through a name in it: a hard link made from outside the tree, and every write through
//! it, would reach no directory watch (`watch.rs` in the tests shows it). A watch on the file's
//! inode reports both — the link count's change and every write, whatever name was used.
//!
//! A context's tag is `<watcher id>:<generation>`. The id is random per process, so a tag from a
//! watcher that has since restarted matches nothing. A context is **stale** when its watches may
//! no longer cover its tree — a directory came, went or moved, the kernel dropped a directory's
//! watch, the queue overflowed, or its path now names another directory — and a stale context is
//! watched anew (top-down, each directory watched before it is read) before it is answered,
//! always with a new generation. A file that appears in a watched directory is watched as soon as
//! its event is taken in, which is before any answer that follows it. So an answer is only ever
//! repeated for a tree whose every directory and file was watched, without a single event, since
//! the answer was first given.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fs;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kiln_core::digest::{WalkFilter, WalkOptions};
use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};

use super::protocol;

/// Filesystems whose changes inotify reports, by `statfs` magic. A context on any other (NFS,
/// SMB, FUSE …) may change without an event, so it is refused and `kiln` walks it.
const LOCAL_FILESYSTEMS: &[(u64, &str)] = &[
    (0xEF53, "ext2/3/4"),
    (0x5846_5342, "xfs"),
    (0x9123_683E, "btrfs"),
    (0x0102_1994, "tmpfs"),
    (0x858_458F6, "ramfs"),
    (0x794C_7630, "overlayfs"),
    (0xF2F5_2010, "f2fs"),
    (0x2FC1_2FC1, "zfs"),
    (0xCA45_1A4E, "bcachefs"),
];

/// At most this many contexts are watched at once; a question about one more is refused.
const MAX_ROOTS: usize = 1024;

/// What a directory's watch reports: every change of a name in it, and its own end.
const DIR_EVENTS: WatchFlags = WatchFlags::MODIFY
    .union(WatchFlags::ATTRIB)
    .union(WatchFlags::CREATE)
    .union(WatchFlags::DELETE)
    .union(WatchFlags::DELETE_SELF)
    .union(WatchFlags::MOVE_SELF)
    .union(WatchFlags::MOVED_FROM)
    .union(WatchFlags::MOVED_TO)
    .union(WatchFlags::DONT_FOLLOW)
    .union(WatchFlags::ONLYDIR);

/// What a file's watch reports: a write or truncation, and a change of mode, times or link count.
const FILE_EVENTS: WatchFlags = WatchFlags::MODIFY.union(WatchFlags::ATTRIB).union(WatchFlags::DONT_FOLLOW);

/// The watcher's state; shared by the connections and the thread that drains the queue.
#[derive(Debug)]
pub struct Watcher {
    fd: Arc<OwnedFd>,
    state: Mutex<State>,
}

/// A context as a walk sees it: its canonical path and the Dockerfile its walk always keeps
/// (`WalkOptions::dockerfile`), which decide together what the walk reads.
pub type Context = (PathBuf, Option<String>);

#[derive(Debug)]
struct State {
    fd: Arc<OwnedFd>,
    id: String,
    /// The last generation given out (every bump takes the next one, so a generation is never
    /// reused, even by another context).
    counter: u64,
    roots: HashMap<Context, Root>,
    watches: HashMap<i32, Watched>,
    /// Why each context last refused was refused, so that a refusal is said once, not per question.
    refused: HashMap<Context, String>,
}

/// One watch: what it is on, and the contexts it covers (nested contexts share their inner part).
#[derive(Debug)]
struct Watched {
    path: PathBuf,
    dir: bool,
    roots: Vec<Context>,
}

#[derive(Debug)]
struct Root {
    dev: u64,
    ino: u64,
    gen: u64,
    wds: HashSet<i32>,
    stale: bool,
    /// What its walk leaves out, from its `.dockerignore` when it was last watched anew: nothing
    /// the walk never reads is watched, and no event about it moves the tag.
    filter: Option<WalkFilter>,
}

impl Root {
    /// Whether a change of the entry at `rel` (relative to the context) can change its walk.
    fn cares(&self, rel: &[u8], is_dir: bool) -> bool {
        match &self.filter {
            Some(f) if is_dir => !f.skips_dir(rel),
            Some(f) => !f.skips_file(rel),
            None => true,
        }
    }
}

impl Watcher {
    pub fn new() -> io::Result<Watcher> {
        let fd = Arc::new(inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)?);
        let id = format!("{:016x}{:016x}", fastrand::u64(..), std::process::id());
        let state = State {
            fd: fd.clone(),
            id,
            counter: 0,
            roots: HashMap::new(),
            watches: HashMap::new(),
            refused: HashMap::new(),
        };
        Ok(Watcher { fd, state: Mutex::new(state) })
    }

    /// The tag of each context now, or why it cannot be watched.
    pub fn answer(&self, contexts: &[Context]) -> Vec<Result<Vec<u8>, String>> {
        let mut state = self.lock();
        // Every change that finished before the question is in the queue now: take them in first.
        state.drain();
        contexts.iter().map(|context| state.tag(context).map(String::into_bytes)).collect()
    }

    /// How many contexts are watched, and how many watches cover them.
    pub fn counts(&self) -> (usize, usize) {
        let state = self.lock();
        (state.roots.len(), state.watches.len())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves nothing half-done that a tag depends on unsafely:
        // the worst is a context left stale, which is answered anew.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Waits up to `timeout` for events and takes them in, so the queue does not overflow while
    /// nobody asks, and new files are watched soon after they appear.
    fn drain_when_ready(&self, timeout: Duration) {
        let timeout = rustix::event::Timespec { tv_sec: 0, tv_nsec: timeout.as_nanos().min(999_999_999) as i64 };
        let mut poll = [rustix::event::PollFd::new(&*self.fd, rustix::event::PollFlags::IN)];
        if matches!(rustix::event::poll(&mut poll, Some(&timeout)), Ok(n) if n > 0) {
            self.lock().drain();
        }
    }
}

impl State {
    fn bump(counter: &mut u64, root: &mut Root) {
        *counter += 1;
        root.gen = *counter;
    }

    /// Takes in every queued event.
    fn drain(&mut self) {
        let mut events = Vec::new();
        let mut buf = vec![MaybeUninit::<u8>::uninit(); 64 << 10];
        let mut reader = inotify::Reader::new(self.fd.as_fd(), &mut buf);
        loop {
            match reader.next() {
                Ok(event) => {
                    let name = event.file_name().map(|n| n.to_bytes().to_vec()).unwrap_or_default();
                    events.push((event.wd(), event.events(), name));
                }
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => {
                    // Events may have been lost: nothing may be vouched for without a new look.
                    events.push((-1, ReadFlags::QUEUE_OVERFLOW, Vec::new()));
                    break;
                }
            }
        }
        for (wd, flags, name) in events {
            self.apply(wd, flags, &name);
        }
    }

    fn apply(&mut self, wd: i32, flags: ReadFlags, name: &[u8]) {
        if flags.contains(ReadFlags::QUEUE_OVERFLOW) {
            for root in self.roots.values_mut() {
                root.stale = true;
                State::bump(&mut self.counter, root);
            }
            return;
        }
        let dropped = flags.intersects(ReadFlags::IGNORED | ReadFlags::UNMOUNT);
        let Some(watched) = self.watches.get(&wd) else { return };
        let (dir, at) = (watched.dir, watched.path.clone());
        let is_dir = flags.contains(ReadFlags::ISDIR);
        // A file's watch ending (the file was deleted) changes no coverage: its directory's
        // watch reported the delete. A directory's ending, or any change of directories, does.
        let structural = (dir && (dropped || flags.intersects(ReadFlags::DELETE_SELF | ReadFlags::MOVE_SELF)))
            || (is_dir
                && flags
                    .intersects(ReadFlags::CREATE | ReadFlags::DELETE | ReadFlags::MOVED_FROM | ReadFlags::MOVED_TO));
        let appeared = dir && !is_dir && flags.intersects(ReadFlags::CREATE | ReadFlags::MOVED_TO);
        let owners = watched.roots.clone();
        if dropped {
            self.watches.remove(&wd);
        }
        let mut to_watch = Vec::new();
        for key in owners {
            let Some(root) = self.roots.get_mut(&key) else { continue };
            if dropped {
                root.wds.remove(&wd);
            }
            // What the event names, relative to the context: a name in a watched directory, or
            // the watched file or directory itself.
            let mut rel = at.strip_prefix(&key.0).map(|p| p.as_os_str().as_bytes().to_vec()).unwrap_or_default();
            if !name.is_empty() {
                if !rel.is_empty() {
                    rel.push(b'/');
                }
                rel.extend_from_slice(name);
                if !root.cares(&rel, is_dir) {
                    continue;
                }
            }
            // New ignore rules change what the walk reads, and what must be watched.
            root.stale |= structural || rel == b".dockerignore";
            State::bump(&mut self.counter, root);
            if appeared {
                to_watch.push(key);
            }
        }
        for key in to_watch {
            // A file that cannot be watched leaves a gap: the context is looked at anew.
            let file = at.join(OsStr::from_bytes(name));
            if self.watch(&key, &file, false).is_err() {
                if let Some(root) = self.roots.get_mut(&key) {
                    root.stale = true;
                }
            }
        }
    }

    fn tag(&mut self, key: &Context) -> Result<String, String> {
        let path = &key.0;
        if !path.is_absolute() {
            return Err(format!("{} is not an absolute path", path.display()));
        }
        let meta = match fs::metadata(path) {
            Ok(meta) if meta.is_dir() => meta,
            Ok(_) => return Err(self.forget(key, format!("{} is not a directory", path.display()))),
            Err(err) => return Err(self.forget(key, format!("cannot read {}: {err}", path.display()))),
        };
        if !self.roots.contains_key(key) {
            if self.roots.len() >= MAX_ROOTS {
                return Err(format!("the watcher already watches {MAX_ROOTS} contexts; restart it to start afresh"));
            }
            let root = Root { dev: 0, ino: 0, gen: 0, wds: HashSet::new(), stale: true, filter: None };
            self.roots.insert(key.clone(), root);
        }
        let root = &self.roots[key];
        // The path may name another directory now (it or a parent was moved or replaced): its
        // watches are on the old one.
        let moved = (meta.dev(), meta.ino()) != (root.dev, root.ino);
        let first = root.gen == 0;
        if root.stale || moved {
            if let Err(why) = self.rewatch(key, &meta) {
                // Said where the person who started the watcher reads, once per context and
                // reason: `kiln` itself just walks.
                if self.refused.len() >= MAX_ROOTS {
                    self.refused.clear();
                }
                if self.refused.insert(key.clone(), why.clone()).as_ref() != Some(&why) {
                    eprintln!("kiln watch: not watching {}: {why} — kiln walks it every time", path.display());
                }
                return Err(self.forget(key, why));
            }
            self.refused.remove(key);
            if first {
                let watches = self.roots[key].wds.len();
                eprintln!("kiln watch: watching {} ({watches} folders and files)", path.display());
            }
        }
        let root = &self.roots[key];
        Ok(format!("{}:{}", self.id, root.gen))
    }

    /// Watches `target` (a directory, or a file) for the context `key`. `Ok(None)` when it is
    /// gone or no longer of that kind: the watch of its directory has the event.
    fn watch(&mut self, key: &Context, target: &Path, dir: bool) -> Result<Option<i32>, String> {
        let flags = if dir { DIR_EVENTS } else { FILE_EVENTS };
        let wd = match inotify::add_watch(self.fd.as_fd(), target, flags) {
            Ok(wd) => wd,
            Err(rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR | rustix::io::Errno::LOOP) if target != key.0 => {
                return Ok(None)
            }
            Err(rustix::io::Errno::NOSPC) => {
                return Err("the kernel's limit of inotify watches is reached (fs.inotify.max_user_watches): \
                            raise it, or watch fewer contexts"
                    .to_string())
            }
            Err(err) => return Err(format!("cannot watch {}: {err}", target.display())),
        };
        let watched =
            self.watches.entry(wd).or_insert_with(|| Watched { path: PathBuf::new(), dir, roots: Vec::new() });
        watched.path = target.to_path_buf();
        watched.dir = dir;
        if !watched.roots.contains(key) {
            watched.roots.push(key.clone());
        }
        if let Some(r) = self.roots.get_mut(key) {
            r.wds.insert(wd);
        }
        Ok(Some(wd))
    }

    /// Watches every directory and file the walk of `key` reads, anew: each directory before it
    /// is read (so an entry added after the read is an event), with the `.dockerignore` read
    /// first; and drops the watches no longer needed.
    fn rewatch(&mut self, key: &Context, meta: &fs::Metadata) -> Result<(), String> {
        let path = key.0.as_path();
        check_filesystem(path)?;
        // The rules are read after the root's watch is in place: an edit of `.dockerignore`
        // after this read is an event, which makes the context stale again.
        let root_wd = self.watch(key, path, true)?;
        let ignore = path.join(".dockerignore");
        if fs::symlink_metadata(&ignore).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(format!("{} is a symlink: a change of what it names may not be seen", ignore.display()));
        }
        let opts = WalkOptions { dockerfile: key.1.clone() };
        let filter = WalkFilter::load(path, &opts).map_err(|err| kiln_core::error_chain(&err))?;
        let mut found: HashSet<i32> = root_wd.into_iter().collect();
        let mut devices = HashSet::new();
        let mut pending = vec![(path.to_path_buf(), Vec::new())];
        while let Some((dir, rel)) = pending.pop() {
            let dev = match fs::symlink_metadata(&dir) {
                Ok(m) => m.dev(),
                Err(err) if err.kind() == io::ErrorKind::NotFound && dir != path => continue,
                Err(err) => return Err(format!("cannot read {}: {err}", dir.display())),
            };
            if devices.insert(dev) {
                check_filesystem(&dir)?;
            }
            let Some(wd) = self.watch(key, &dir, true)? else { continue };
            found.insert(wd);
            let entries = match fs::read_dir(&dir) {
                Ok(entries) => entries,
                Err(err) if err.kind() == io::ErrorKind::NotFound && dir != path => continue,
                Err(err) => return Err(format!("cannot read {}: {err}", dir.display())),
            };
            for entry in entries {
                let entry = entry.map_err(|err| format!("cannot read {}: {err}", dir.display()))?;
                let mut child = rel.clone();
                if !child.is_empty() {
                    child.push(b'/');
                }
                child.extend_from_slice(entry.file_name().as_bytes());
                match entry.file_type() {
                    Ok(t) if t.is_dir() && !filter.skips_dir(&child) => pending.push((entry.path(), child)),
                    Ok(t) if t.is_file() && !filter.skips_file(&child) => {
                        if let Some(wd) = self.watch(key, &entry.path(), false)? {
                            found.insert(wd);
                        }
                    }
                    // What the walk leaves out; a symlink, whose target is its content (it is not
                    // followed); anything else the walk refuses.
                    _ => {}
                }
            }
        }
        let root = self.roots.get_mut(key).expect("a root is inserted before it is watched");
        let old: Vec<i32> = root.wds.difference(&found).copied().collect();
        root.wds = found;
        root.dev = meta.dev();
        root.ino = meta.ino();
        root.stale = false;
        root.filter = Some(filter);
        State::bump(&mut self.counter, root);
        for wd in old {
            self.release(wd, key);
        }
        Ok(())
    }

    /// Stops watching `key` (gone, or not watchable) and passes `why` on.
    fn forget(&mut self, key: &Context, why: String) -> String {
        if let Some(root) = self.roots.remove(key) {
            for wd in root.wds {
                self.release(wd, key);
            }
        }
        why
    }

    /// `key` no longer needs `wd`; the last context to let go removes the watch.
    fn release(&mut self, wd: i32, key: &Context) {
        if let Some(watched) = self.watches.get_mut(&wd) {
            watched.roots.retain(|k| k != key);
            if watched.roots.is_empty() {
                self.watches.remove(&wd);
                let _ = inotify::remove_watch(self.fd.as_fd(), wd);
            }
        }
    }
}

fn check_filesystem(dir: &Path) -> Result<(), String> {
    let stat = rustix::fs::statfs(dir).map_err(|err| format!("cannot statfs {}: {err}", dir.display()))?;
    let magic = stat.f_type as u64;
    match LOCAL_FILESYSTEMS.iter().any(|(m, _)| *m == magic) {
        true => Ok(()),
        false => Err(format!(
            "{} is on a filesystem whose changes inotify may not report (type {magic:#x}); it is walked every time",
            dir.display()
        )),
    }
}

/// A running watcher: its socket, and the threads that serve it.
#[derive(Debug)]
pub struct WatcherHandle {
    pub socket: PathBuf,
    pub watcher: Arc<Watcher>,
    stop: Arc<AtomicBool>,
}

impl WatcherHandle {
    /// Stops answering and removes the socket (the threads end at their next wake-up).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which then sees the flag.
        let _ = UnixStream::connect(&self.socket);
        let _ = fs::remove_file(&self.socket);
    }
}

impl Drop for WatcherHandle {
    fn drop(&mut self) {
        if !self.stop.load(Ordering::SeqCst) {
            self.stop();
        }
    }
}

/// Starts a watcher answering on `socket`, in threads of this process. Refuses when another
/// watcher answers there; a socket file nobody answers on (a watcher that was killed) is replaced.
/// A missing folder for it is made only its user's (0700), and the socket itself is 0600: only
/// its user may ask (connecting needs write access to the socket file).
pub fn serve(socket: &Path) -> io::Result<WatcherHandle> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    if let Some(dir) = socket.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    }
    if UnixStream::connect(socket).is_ok() {
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("a kiln watcher already answers on {}", socket.display()),
        ));
    }
    match fs::remove_file(socket) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => return Err(err),
        _ => {}
    }
    let listener = UnixListener::bind(socket)?;
    fs::set_permissions(socket, fs::Permissions::from_mode(0o600))?;
    let watcher = Arc::new(Watcher::new()?);
    let stop = Arc::new(AtomicBool::new(false));

    let (w, s) = (watcher.clone(), stop.clone());
    std::thread::Builder::new().name("kiln-watch-drain".into()).spawn(move || {
        while !s.load(Ordering::SeqCst) {
            w.drain_when_ready(Duration::from_millis(250));
        }
    })?;
    let (w, s) = (watcher.clone(), stop.clone());
    std::thread::Builder::new().name("kiln-watch-accept".into()).spawn(move || {
        for stream in listener.incoming() {
            if s.load(Ordering::SeqCst) {
                break;
            }
            let Ok(stream) = stream else { continue };
            let w = w.clone();
            let _ = std::thread::Builder::new().name("kiln-watch-answer".into()).spawn(move || answer_one(&w, stream));
        }
    })?;
    Ok(WatcherHandle { socket: socket.to_path_buf(), watcher, stop })
}

/// One connection: a question, its answers. A client that stalls is dropped after a while.
fn answer_one(watcher: &Watcher, mut stream: UnixStream) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
    let Ok(roots) = protocol::read_question(&mut stream) else { return };
    let answers = watcher.answer(&roots);
    let _ = protocol::write_answers(&mut stream, &answers);
}
