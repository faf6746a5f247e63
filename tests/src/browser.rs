//! A real browser for tests that look at a page as a person would: Debian's `chromedriver` on a
//! free loopback port, driving headless Chromium (../shared/COMPONENTS.md). There is no systemd
//! and nothing starts by itself, so the test starts the driver and stops it by its process group
//! when dropped — the driver and every Chromium it started, even after a failed assertion.
//!
//! A missing browser fails the test, naming the packages: `scripts/setup` installs them, and a
//! test that skipped quietly would let CI pass with the page untested.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The Chromium a WebDriver session should start: Debian's launcher script, which finds the
/// real binary and its libraries.
pub const CHROMIUM: &str = "/usr/bin/chromium";

/// A running `chromedriver`.
#[derive(Debug)]
pub struct ChromeDriver {
    child: Child,
    /// The WebDriver endpoint, `http://127.0.0.1:<port>`.
    pub url: String,
}

impl ChromeDriver {
    /// Starts `chromedriver` on a free loopback port, its log in `log`, and waits until it is ready.
    pub fn start(log: &Path) -> ChromeDriver {
        for (binary, package) in [("chromedriver", "chromium-driver"), ("chromium", "chromium")] {
            let found = Command::new("sh")
                .args(["-c", &format!("command -v {binary}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            assert!(
                found,
                "{binary} is not installed: `apt-get install chromium chromium-driver` (scripts/setup does) — the status page is tested in a real browser ({package})"
            );
        }
        let port = crate::free_addr().port();
        let log_file = std::fs::File::create(log).unwrap();
        let child = {
            use std::os::unix::process::CommandExt;
            Command::new("chromedriver")
                .arg(format!("--port={port}"))
                .arg("--allowed-ips=127.0.0.1")
                .stdout(log_file.try_clone().unwrap())
                .stderr(log_file)
                // Its own process group: dropping the driver takes the browsers it started along.
                .process_group(0)
                .spawn()
                .expect("start chromedriver")
        };
        let driver = ChromeDriver { child, url: format!("http://127.0.0.1:{port}") };
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            assert!(
                Instant::now() < deadline,
                "chromedriver did not listen on {addr} within 20 s; see {}",
                log.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        driver
    }

    /// WebDriver capabilities for headless Chromium in a `width`×`height` window, its profile
    /// under `profile` (so nothing lands in the user's home, and two tests never share one).
    pub fn capabilities(width: u32, height: u32, profile: &Path) -> serde_json::Map<String, serde_json::Value> {
        let args = [
            "--headless=new".to_string(),
            // Root on these machines: Chromium's sandbox refuses to start as root.
            "--no-sandbox".to_string(),
            "--disable-gpu".to_string(),
            "--disable-dev-shm-usage".to_string(),
            format!("--window-size={width},{height}"),
            format!("--user-data-dir={}", profile.display()),
        ];
        let options = serde_json::json!({ "binary": CHROMIUM, "args": args });
        serde_json::Map::from_iter([("goog:chromeOptions".to_string(), options)])
    }
}

impl Drop for ChromeDriver {
    fn drop(&mut self) {
        // The group the driver leads (its pid): the driver and the browsers it started.
        let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", self.child.id())]).status();
        let _ = self.child.wait();
    }
}
