//! Where the embedded coordinator keeps its state, and who is asking.
//!
//! One `$KILN_HOME` per user, shared by every instance converged there (DESIGN.md "Where state
//! lives"): state kept per instance folder would make one instance's sweep see every other
//! instance's images as unreachable. The farm id is derived from the user and the *canonical* home,
//! so `~/.local/share/kiln` and a symlink to it are one farm, and a wiped state rebuilt in the same
//! home still recognizes the images it labeled.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::error::CliError;

/// The embedded coordinator's home, resolved and created, with the identities derived from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmbeddedSite {
    /// Canonical (absolute, symlinks resolved).
    pub home: PathBuf,
    pub user: String,
    pub host: String,
    /// `kiln.dev/farm` of every image this home's coordinator builds.
    pub farm: String,
}

impl EmbeddedSite {
    /// Resolves the home (`home` if given, else `$KILN_HOME`, else `~/.local/share/kiln`), creates
    /// it and its `state/` and `scratch/` folders, and derives the farm id.
    pub fn prepare(home: Option<&Path>) -> Result<EmbeddedSite, CliError> {
        let home = match home {
            Some(home) => home.to_path_buf(),
            None => home_dir(std::env::var_os("KILN_HOME"), std::env::var_os("HOME")).ok_or(CliError::NoHome)?,
        };
        for dir in [home.clone(), home.join("state"), home.join("scratch")] {
            std::fs::create_dir_all(&dir).map_err(|err| CliError::Home { path: dir.clone(), err })?;
        }
        let home = std::fs::canonicalize(&home).map_err(|err| CliError::Home { path: home.clone(), err })?;
        let user = current_user();
        let farm = kiln_core::farm::embedded_farm_id(&user, &home);
        Ok(EmbeddedSite { home, user, host: host_name(), farm })
    }

    /// The coordinator's SQLite state and context store.
    pub fn state_dir(&self) -> PathBuf {
        self.home.join("state")
    }

    /// Where the embedded agent unpacks contexts before a build.
    pub fn scratch_dir(&self) -> PathBuf {
        self.home.join("scratch")
    }

    /// How messages name the embedded coordinator: by its home, the one thing the user chose.
    pub fn describe(&self) -> String {
        format!("the embedded coordinator (KILN_HOME {})", self.home.display())
    }

    /// `embedded-<hostname>`.
    pub fn agent_id(&self) -> String {
        format!("embedded-{}", self.host)
    }
}

/// Where the stat cache of every context lives: under the embedded coordinator's home when there
/// is one (everything embedded Kiln keeps is in one folder to back up or wipe), else in the
/// user's cache directory (`$XDG_CACHE_HOME/kiln/stat`, `~/.cache/kiln/stat`). `None` without
/// either: every file is then read, as it is with no cache.
pub fn stat_cache_dir(embedded: bool, kiln_home: Option<&Path>) -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v: &OsString| !v.is_empty());
    stat_dir_from(embedded, kiln_home.map(Path::to_path_buf), var("KILN_HOME"), var("XDG_CACHE_HOME"), var("HOME"))
}

fn stat_dir_from(
    embedded: bool,
    explicit_home: Option<PathBuf>,
    kiln_home: Option<OsString>,
    xdg_cache: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    if embedded {
        let home = explicit_home.or_else(|| home_dir(kiln_home, home.clone()))?;
        return Some(home.join("stat"));
    }
    match xdg_cache {
        Some(cache) => Some(PathBuf::from(cache).join("kiln/stat")),
        None => home.map(|h| PathBuf::from(h).join(".cache/kiln/stat")),
    }
}

/// `$KILN_HOME` when set and non-empty, else `$HOME/.local/share/kiln`; `None` without either.
/// A relative `$KILN_HOME` is taken from the current directory (and canonicalized later).
pub fn home_dir(kiln_home: Option<OsString>, home: Option<OsString>) -> Option<PathBuf> {
    match kiln_home.filter(|h| !h.is_empty()) {
        Some(kiln_home) => Some(PathBuf::from(kiln_home)),
        None => home.filter(|h| !h.is_empty()).map(|h| PathBuf::from(h).join(".local/share/kiln")),
    }
}

/// `$USER`, else `$LOGNAME`, else `uid-<n>` of this process — stable for one account, which is
/// what the farm id needs.
pub fn current_user() -> String {
    use std::os::unix::fs::MetadataExt;
    for var in ["USER", "LOGNAME"] {
        if let Some(user) = std::env::var_os(var).filter(|u| !u.is_empty()) {
            return user.to_string_lossy().into_owned();
        }
    }
    match std::fs::metadata("/proc/self") {
        Ok(meta) => format!("uid-{}", meta.uid()),
        Err(_) => "unknown".to_string(),
    }
}

/// The kernel's host name, else `/etc/hostname`, else `localhost`.
pub fn host_name() -> String {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok())
        .map(|name| name.trim().to_string())
        .find(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// `user@host`, for `UpRequest.requested_by`.
pub fn requested_by() -> String {
    format!("{}@{}", current_user(), host_name())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kiln_home_wins_then_the_xdg_default_under_home() {
        let dir = home_dir(Some("/srv/kiln".into()), Some("/home/ana".into()));
        assert_eq!(dir, Some(PathBuf::from("/srv/kiln")));
        let dir = home_dir(None, Some("/home/ana".into()));
        assert_eq!(dir, Some(PathBuf::from("/home/ana/.local/share/kiln")));
        let dir = home_dir(Some("".into()), Some("/home/ana".into()));
        assert_eq!(dir, Some(PathBuf::from("/home/ana/.local/share/kiln")), "an empty KILN_HOME is unset");
        assert_eq!(home_dir(None, None), None);
    }

    #[test]
    fn the_stat_cache_lives_in_the_embedded_home_else_the_cache_dir() {
        let at = |embedded, explicit: Option<&str>, kiln: Option<&str>, xdg: Option<&str>| {
            stat_dir_from(
                embedded,
                explicit.map(PathBuf::from),
                kiln.map(Into::into),
                xdg.map(Into::into),
                Some("/home/ana".into()),
            )
        };
        assert_eq!(at(true, None, None, None), Some(PathBuf::from("/home/ana/.local/share/kiln/stat")));
        assert_eq!(at(true, None, Some("/srv/k"), Some("/c")), Some(PathBuf::from("/srv/k/stat")));
        assert_eq!(at(true, Some("/tmp/h"), Some("/srv/k"), None), Some(PathBuf::from("/tmp/h/stat")));
        assert_eq!(at(false, None, Some("/srv/k"), Some("/c")), Some(PathBuf::from("/c/kiln/stat")));
        assert_eq!(at(false, None, None, None), Some(PathBuf::from("/home/ana/.cache/kiln/stat")));
        assert_eq!(stat_dir_from(false, None, None, None, None), None);
    }

    #[test]
    fn the_farm_follows_the_canonical_home() {
        let tmp = tempfile::tempdir().unwrap();
        let a = EmbeddedSite::prepare(Some(&tmp.path().join("a"))).unwrap();
        let b = EmbeddedSite::prepare(Some(&tmp.path().join("b"))).unwrap();
        assert_ne!(a.farm, b.farm, "two homes are two farms");
        assert!(a.state_dir().is_dir() && a.scratch_dir().is_dir());

        let again = EmbeddedSite::prepare(Some(&tmp.path().join("a"))).unwrap();
        assert_eq!(again.farm, a.farm, "the same home is the same farm");
        std::os::unix::fs::symlink(tmp.path().join("a"), tmp.path().join("link")).unwrap();
        let via_link = EmbeddedSite::prepare(Some(&tmp.path().join("link/../a/./"))).unwrap();
        assert_eq!(via_link.home, a.home);
        assert_eq!(via_link.farm, a.farm, "another spelling of the same home is the same farm");
        assert_eq!(a.farm, kiln_core::farm::embedded_farm_id(&a.user, &a.home));
    }

    #[test]
    fn the_agent_is_named_after_the_host() {
        let site = EmbeddedSite { home: "/h".into(), user: "ana".into(), host: "box".into(), farm: "f".into() };
        assert_eq!(site.agent_id(), "embedded-box");
    }
}
