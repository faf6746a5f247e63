//! A throwaway PostgreSQL cluster (Debian's `postgresql`, ../shared/COMPONENTS.md): `initdb` in a
//! temp dir as the `postgres` user (initdb refuses root), the postmaster on a free loopback port,
//! no system service. [`Postgres::shared`] starts one per test binary; each test takes its own
//! database from it ([`Postgres::create_database`]), so tests run in parallel without seeing each
//! other's rows. [`Postgres::start`] gives a test a cluster of its own, e.g. to kill it.
//!
//! A cluster is stopped by its postmaster's PID — when dropped, and in any case when the test
//! binary exits, however it exits: a watchdog process reads a pipe only this process holds, and
//! on its end-of-file (the kernel closes it at exit, even on a panic or SIGKILL) stops the
//! postmaster and removes the directory. Nothing is left running after `cargo test`.
//!
//! PostgreSQL missing is a loud failure naming the fix, never a skipped test: CI must not go green
//! having tested one backend of two. `KILN_TEST_POSTGRES_BIN` points at another bin directory.

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Settings for a test cluster: durability off (a crashed test cluster is thrown away anyway),
/// room for many tests' pools at once.
const TEST_SETTINGS: &[(&str, &str)] =
    &[("fsync", "off"), ("synchronous_commit", "off"), ("full_page_writes", "off"), ("max_connections", "300")];

/// A running PostgreSQL cluster, reachable as the `postgres` superuser without a password.
#[derive(Debug)]
pub struct Postgres {
    /// `127.0.0.1:<port>`.
    pub addr: String,
    pid: u32,
    dir: PathBuf,
    /// The postmaster, reaped on drop (at exit, whoever adopts it reaps it).
    postmaster: Mutex<Option<Child>>,
    watchdog: Mutex<Option<(ChildStdin, Child)>>,
    databases: AtomicUsize,
}

/// One test's database in a cluster.
#[derive(Clone, Debug)]
pub struct Database {
    pub name: String,
    /// `postgres://postgres@127.0.0.1:<port>/<name>`
    pub url: String,
}

impl Postgres {
    /// The test binary's cluster, started by the first test that asks (with [`TEST_SETTINGS`]).
    pub fn shared() -> &'static Postgres {
        static SHARED: OnceLock<Postgres> = OnceLock::new();
        SHARED.get_or_init(|| Postgres::start_with(TEST_SETTINGS))
    }

    /// A cluster of this test's own (with [`TEST_SETTINGS`]), stopped when dropped.
    pub fn start() -> Postgres {
        Postgres::start_with(TEST_SETTINGS)
    }

    /// A cluster with PostgreSQL's default settings (fsync on), for measuring.
    pub fn start_durable() -> Postgres {
        Postgres::start_with(&[])
    }

    fn start_with(settings: &[(&str, &str)]) -> Postgres {
        let bin = bin_dir();
        let owner = Owner::find();
        // As root the cluster runs as `postgres`, who must reach its directory: /tmp, not a $TMPDIR
        // that may sit under root's home.
        let parent = if owner.ids.is_some() { PathBuf::from("/tmp") } else { std::env::temp_dir() };
        let tmp =
            tempfile::Builder::new().prefix("kiln-pg-").tempdir_in(parent).expect("creating a temp dir for PostgreSQL");
        let dir = tmp.keep();
        owner.give(&dir);
        let data = dir.join("data");
        let initdb = owner
            .command(bin.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C", "--no-sync", "-D"])
            .arg(&data)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", bin.join("initdb").display()));
        assert!(initdb.status.success(), "initdb failed: {}", String::from_utf8_lossy(&initdb.stderr));

        // A free port can be taken between our probe and the postmaster's bind: try a few.
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let log = std::fs::File::create(dir.join("postgres.log")).unwrap();
            let mut command = owner.command(bin.join("postgres"));
            command
                .arg("-D")
                .arg(&data)
                .args(["-p", &port.to_string(), "-k"])
                .arg(&dir)
                .args(["-c", "listen_addresses=127.0.0.1"]);
            for (name, value) in settings {
                command.args(["-c", &format!("{name}={value}")]);
            }
            let postmaster =
                command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log).spawn().expect("starting postgres");
            let pid = postmaster.id();
            // From here the watchdog owns stopping it, whatever happens to this process.
            let watchdog = watchdog(pid, &dir);
            let pg = Postgres {
                addr: format!("127.0.0.1:{port}"),
                pid,
                dir: dir.clone(),
                postmaster: Mutex::new(Some(postmaster)),
                watchdog: Mutex::new(Some(watchdog)),
                databases: AtomicUsize::new(0),
            };
            // initdb's cluster has nothing to recover: it is ready in about a second.
            for _ in 0..1500 {
                if pg.exited() {
                    // Most likely the port was taken meanwhile: try another.
                    let log = std::fs::read_to_string(dir.join("postgres.log")).unwrap_or_default();
                    eprintln!("postgres exited on port {port}: {log}");
                    break;
                }
                if pg.ready(&data) {
                    return pg;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            drop(pg);
        }
        let log = std::fs::read_to_string(dir.join("postgres.log")).unwrap_or_default();
        panic!("PostgreSQL did not start in {}: {log}", dir.display());
    }

    /// What the postmaster logged so far, for a failing test to show.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default()
    }

    /// The postmaster's PID (to stop or pause it in a test).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// `postgres://postgres@127.0.0.1:<port>/<database>`
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@{}/{database}", self.addr)
    }

    /// A fresh, empty database of this test's own.
    pub async fn create_database(&self) -> Database {
        let n = self.databases.fetch_add(1, Ordering::SeqCst);
        let name = format!("kiln_test_{}_{n}", std::process::id());
        let (client, connection) = tokio_postgres::connect(&self.url("postgres"), tokio_postgres::NoTls)
            .await
            .expect("connecting to postgres");
        let connection = tokio::spawn(connection);
        client.batch_execute(&format!("CREATE DATABASE {name}")).await.expect("creating a test database");
        drop(client);
        let _ = connection.await;
        Database { url: self.url(&name), name }
    }

    /// Whether the postmaster says it accepts connections: the status line of `postmaster.pid`
    /// (what `pg_ctl -w` reads), so this works from inside an async test without a runtime.
    fn ready(&self, data: &Path) -> bool {
        let pidfile = std::fs::read_to_string(data.join("postmaster.pid")).unwrap_or_default();
        pidfile.lines().nth(7).is_some_and(|status| status.trim() == "ready")
    }

    fn exited(&self) -> bool {
        let mut postmaster = self.postmaster.lock().unwrap_or_else(|e| e.into_inner());
        postmaster.as_mut().is_none_or(|child| !matches!(child.try_wait(), Ok(None)))
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // Closing the pipe is the watchdog's signal; reap the postmaster it stops, then wait until
        // the watchdog has removed the directory.
        let watchdog = self.watchdog.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some((stdin, mut watchdog)) = watchdog {
            drop(stdin);
            if let Some(mut postmaster) = self.postmaster.lock().unwrap_or_else(|e| e.into_inner()).take() {
                let _ = postmaster.wait();
            }
            let _ = watchdog.wait();
        }
    }
}

/// A process that waits for end-of-file on its stdin (a pipe only this process writes), then stops
/// the postmaster `pid` (SIGQUIT: immediate shutdown), waits for it to exit, and removes `dir`.
fn watchdog(pid: u32, dir: &Path) -> (ChildStdin, Child) {
    let mut child = Command::new("sh")
        .args([
            "-c",
            // Waits while the postmaster lives and is not a zombie (a parent that never reaps it
            // must not keep the directory forever), at most 10 s.
            r#"cat >/dev/null; kill -QUIT "$1" 2>/dev/null; i=0
               while [ $i -lt 200 ] && kill -0 "$1" 2>/dev/null && ! grep -q '^State:.*Z' "/proc/$1/status" 2>/dev/null
               do sleep 0.05; i=$((i+1)); done
               rm -rf "$2""#,
            "kiln-pg-watchdog",
        ])
        .arg(pid.to_string())
        .arg(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Its own process group: a Ctrl-C to the test run must not kill the watchdog before it
        // cleaned up (the postmaster gets the Ctrl-C and shuts down fast by itself).
        .process_group(0)
        .spawn()
        .expect("starting the PostgreSQL watchdog (sh)");
    let mut stdin = child.stdin.take().unwrap();
    let _ = stdin.flush();
    (stdin, child)
}

/// The directory of `initdb` and `postgres`: `$KILN_TEST_POSTGRES_BIN`, else the newest
/// `/usr/lib/postgresql/<version>/bin` (Debian's layout; not on PATH).
fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KILN_TEST_POSTGRES_BIN") {
        return PathBuf::from(dir);
    }
    let newest = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str().and_then(|v| v.parse::<u32>().ok()))
        .filter(|version| Path::new(&format!("/usr/lib/postgresql/{version}/bin/initdb")).is_file())
        .max();
    match newest {
        Some(version) => PathBuf::from(format!("/usr/lib/postgresql/{version}/bin")),
        None => panic!(
            "PostgreSQL is not installed: no /usr/lib/postgresql/<version>/bin/initdb — run `bash scripts/setup` \
             (it installs Debian's `postgresql`), or point KILN_TEST_POSTGRES_BIN at a bin directory"
        ),
    }
}

/// Who runs the cluster: the `postgres` user when this process is root (initdb refuses root),
/// else this process's own user.
struct Owner {
    ids: Option<(u32, u32)>,
}

impl Owner {
    fn find() -> Owner {
        let root = std::fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false);
        if !root {
            return Owner { ids: None };
        }
        let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
        let ids = passwd.lines().find_map(|line| {
            let mut fields = line.split(':');
            if fields.next() != Some("postgres") {
                return None;
            }
            let (_password, uid, gid) = (fields.next(), fields.next()?.parse().ok()?, fields.next()?.parse().ok()?);
            Some((uid, gid))
        });
        match ids {
            Some(ids) => Owner { ids: Some(ids) },
            None => panic!(
                "running as root, but there is no `postgres` user to run initdb as — run `bash scripts/setup` \
                 (Debian's `postgresql` package creates it)"
            ),
        }
    }

    fn give(&self, dir: &Path) {
        if let Some((uid, gid)) = self.ids {
            std::os::unix::fs::chown(dir, Some(uid), Some(gid)).expect("handing the cluster's dir to postgres");
        }
    }

    fn command(&self, program: PathBuf) -> Command {
        let mut command = Command::new(program);
        if let Some((uid, gid)) = self.ids {
            command.uid(uid).gid(gid);
        }
        command
    }
}
