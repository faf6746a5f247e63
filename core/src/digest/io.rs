//! The pool the walk and the small-file reads block in. A cold page cache makes each `lstat`,
//! `open` and `read` wait on the disk; with only as many threads as cores, a 2-core machine keeps
//! two requests in flight and the disk idles between them. Blocking calls therefore run on their
//! own wider pool. A small file is hashed on the thread that read it, while its bytes are still in
//! that core's cache (a 4 KiB file hashes in about a microsecond: less than handing it over would
//! cost); big files are hashed on the caller's rayon pool. The number of threads never affects
//! the digest: each file's hash is its own, and the stream is fed in entry order.

use std::sync::OnceLock;

/// Threads of the I/O pool unless `KILN_DIGEST_IO_THREADS` says otherwise: enough requests in
/// flight to keep an SSD or a virtual disk busy, few enough that a warm cache barely notices.
const DEFAULT_IO_THREADS: usize = 16;

fn io_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::env::var("KILN_DIGEST_IO_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or(DEFAULT_IO_THREADS);
        // Without the pool (threads could not be spawned) the work runs on the caller's pool:
        // slower on a cold cache, never wrong.
        rayon::ThreadPoolBuilder::new().num_threads(threads).thread_name(|i| format!("kiln-digest-io-{i}")).build().ok()
    })
    .as_ref()
}

/// Runs `f` (which may use rayon's parallel iterators) on the I/O pool.
pub(super) fn blocking<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    match io_pool() {
        Some(pool) => pool.install(f),
        None => f(),
    }
}
