//! A shipped binary run as a real process, for tests that send it real signals: stopped by its PID
//! when dropped (woken first, in case a test froze it with SIGSTOP).

use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// A running process whose stderr the test reads once it exits.
#[derive(Debug)]
pub struct Proc {
    child: Child,
    name: String,
}

impl Proc {
    /// Spawns `command` with stderr piped (and stdout dropped); `name` is how failures call it.
    pub fn spawn(name: &str, mut command: Command) -> Proc {
        command.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped());
        let child = command.spawn().unwrap_or_else(|err| panic!("cannot start {name}: {err}"));
        Proc { child, name: name.to_string() }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (`-TERM`, `-STOP`, …) with kill(1), as a process manager would.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill").args([signal, &self.child.id().to_string()]).status().unwrap();
        assert!(status.success(), "kill {signal} {} ({})", self.child.id(), self.name);
    }

    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Its exit status and everything it wrote to stderr, once it exits within `within`.
    pub fn exit(&mut self, within: Duration) -> Option<(ExitStatus, String)> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                let mut err = String::new();
                if let Some(mut stderr) = self.child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut stderr, &mut err);
                }
                return Some((status, err));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-CONT", &self.child.id().to_string()]).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
