//! Two entry lists of one context, diffed into the paths that moved — how "context changed"
//! names its files (DESIGN.md "Every image says why").
//!
//! Because the tree digest is a function of the entry list, two lists differ exactly where their
//! digests say the trees differ: a path is listed here iff its entry (type, size, content hash,
//! link target, executable bit) is not the same on both sides. A directory added or removed
//! together with what is under it is implied by those paths and not listed itself; an empty one
//! is (it counts in the digest).

use super::list::shown;
use super::{Entry, EntryKind};

/// How one path moved between two entry lists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum How {
    Added(EntryKind),
    Removed(EntryKind),
    /// A file's contents (its size, or its content hash) changed; the executable bit did not.
    Changed {
        size_before: u64,
        size_after: u64,
    },
    /// A file's executable bit flipped (`executable`: it is now); its contents may have changed too.
    ModeChanged {
        executable: bool,
        content_changed: bool,
    },
    /// File, directory and symlink are different types (file ↔ executable file is a mode).
    TypeChanged {
        from: EntryKind,
        to: EntryKind,
    },
    Retargeted {
        from: Vec<u8>,
        to: Vec<u8>,
    },
}

/// The class a move is shown under: `kiln why`'s headings, `--json`'s keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    Added,
    Removed,
    Changed,
    ModeChanged,
    TypeChanged,
    Retargeted,
}

impl Class {
    pub const ALL: [Class; 6] =
        [Class::Added, Class::Removed, Class::Changed, Class::ModeChanged, Class::TypeChanged, Class::Retargeted];

    /// `added`, `mode_changed`, …: the word `--json` uses.
    pub fn key(self) -> &'static str {
        match self {
            Class::Added => "added",
            Class::Removed => "removed",
            Class::Changed => "changed",
            Class::ModeChanged => "mode_changed",
            Class::TypeChanged => "type_changed",
            Class::Retargeted => "retargeted",
        }
    }

    /// The heading `kiln why` prints.
    pub fn heading(self) -> &'static str {
        match self {
            Class::Added => "added",
            Class::Removed => "removed",
            Class::Changed => "changed",
            Class::ModeChanged => "mode changed",
            Class::TypeChanged => "type changed",
            Class::Retargeted => "symlink retargeted",
        }
    }

    /// The one-character mark of a short list: `+` added, `−` removed, `~` anything else that
    /// changed in place.
    pub fn mark(self) -> &'static str {
        match self {
            Class::Added => "+",
            Class::Removed => "−",
            _ => "~",
        }
    }
}

/// One path that moved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Moved {
    pub path: Vec<u8>,
    pub how: How,
}

impl Moved {
    pub fn class(&self) -> Class {
        match self.how {
            How::Added(_) => Class::Added,
            How::Removed(_) => Class::Removed,
            How::Changed { .. } => Class::Changed,
            How::ModeChanged { .. } => Class::ModeChanged,
            How::TypeChanged { .. } => Class::TypeChanged,
            How::Retargeted { .. } => Class::Retargeted,
        }
    }

    /// The path as a person reads it; a directory ends in `/`.
    pub fn shown(&self) -> String {
        let dir = matches!(self.how, How::Added(EntryKind::Dir) | How::Removed(EntryKind::Dir));
        let path = shown(&self.path);
        if dir {
            format!("{path}/")
        } else {
            path
        }
    }

    /// What changed beyond the path, for `kiln why`: `120 → 164 bytes`, `now executable`,
    /// `file → dir`, `v1 → v2`; empty for an addition or removal.
    pub fn detail(&self) -> String {
        match &self.how {
            How::Added(_) | How::Removed(_) => String::new(),
            How::Changed { size_before, size_after } if size_before == size_after => {
                format!("same size, {size_after} bytes")
            }
            How::Changed { size_before, size_after } => format!("{size_before} → {size_after} bytes"),
            How::ModeChanged { executable, content_changed } => {
                let mode = if *executable { "now executable" } else { "no longer executable" };
                if *content_changed {
                    format!("{mode}; contents changed too")
                } else {
                    mode.to_string()
                }
            }
            How::TypeChanged { from, to } => format!("{} → {}", from.name(), to.name()),
            How::Retargeted { from, to } => format!("{} → {}", shown(from), shown(to)),
        }
    }
}

/// Every path that moved from `before` to `after`, in byte order of path. Both lists must be in
/// canonical order (as walks, archives and [`super::list::decode`] give them).
pub fn diff(before: &[Entry], after: &[Entry]) -> Vec<Moved> {
    let mut moved = Vec::new();
    let (mut a, mut b) = (before.iter().peekable(), after.iter().peekable());
    loop {
        let how = match (a.peek(), b.peek()) {
            (None, None) => break,
            (Some(old), Some(new)) if old.path == new.path => {
                let (old, new) = (a.next().expect("peeked"), b.next().expect("peeked"));
                match compare(old, new) {
                    Some(how) => (new.path.clone(), how),
                    None => continue,
                }
            }
            (Some(old), Some(new)) if old.path < new.path => {
                (old.path.clone(), How::Removed(a.next().expect("peeked").kind))
            }
            (Some(_), None) => {
                let old = a.next().expect("peeked");
                (old.path.clone(), How::Removed(old.kind))
            }
            (_, Some(_)) => {
                let new = b.next().expect("peeked");
                (new.path.clone(), How::Added(new.kind))
            }
        };
        moved.push(Moved { path: how.0, how: how.1 });
    }
    drop_implied_dirs(moved)
}

fn compare(old: &Entry, new: &Entry) -> Option<How> {
    use EntryKind::*;
    let file = |k| matches!(k, File | ExecFile);
    match (old.kind, new.kind) {
        (Dir, Dir) => None,
        (Symlink, Symlink) if old.link_target == new.link_target => None,
        (Symlink, Symlink) => Some(How::Retargeted { from: old.link_target.clone(), to: new.link_target.clone() }),
        (o, n) if file(o) && file(n) => {
            let content_changed = old.size != new.size || old.hash != new.hash;
            match (o == n, content_changed) {
                (true, false) => None,
                (true, true) => Some(How::Changed { size_before: old.size, size_after: new.size }),
                (false, _) => Some(How::ModeChanged { executable: n == ExecFile, content_changed }),
            }
        }
        (from, to) => Some(How::TypeChanged { from, to }),
    }
}

/// Drops a directory added (removed) when a path under it was added (removed) too: the deeper
/// paths say it, and a new folder of a hundred files is not a hundred and one moves.
fn drop_implied_dirs(moved: Vec<Moved>) -> Vec<Moved> {
    let implied = |m: &Moved| {
        let kind = match &m.how {
            How::Added(EntryKind::Dir) => Class::Added,
            How::Removed(EntryKind::Dir) => Class::Removed,
            _ => return false,
        };
        let mut prefix = m.path.clone();
        prefix.push(b'/');
        // Paths under `d` sort together, after `d/` — but not necessarily right after `d`.
        let first = moved.partition_point(|other| other.path < prefix);
        moved[first..].first().is_some_and(|under| under.path.starts_with(&prefix) && under.class() == kind)
    };
    let keep: Vec<bool> = moved.iter().map(|m| !implied(m)).collect();
    moved.into_iter().zip(keep).filter_map(|(m, keep)| keep.then_some(m)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::ContentHash;

    fn file(path: &[u8], body: &[u8]) -> Entry {
        let hash = Some(ContentHash::of(body));
        Entry {
            path: path.to_vec(),
            kind: EntryKind::File,
            size: body.len() as u64,
            link_target: vec![],
            stat: None,
            hash,
        }
    }
    fn exec(path: &[u8], body: &[u8]) -> Entry {
        Entry { kind: EntryKind::ExecFile, ..file(path, body) }
    }
    fn dir(path: &[u8]) -> Entry {
        Entry { path: path.to_vec(), kind: EntryKind::Dir, size: 0, link_target: vec![], stat: None, hash: None }
    }
    fn link(path: &[u8], to: &[u8]) -> Entry {
        let target = to.to_vec();
        Entry {
            path: path.to_vec(),
            kind: EntryKind::Symlink,
            size: to.len() as u64,
            link_target: target,
            stat: None,
            hash: None,
        }
    }
    fn shown(moved: &[Moved]) -> Vec<(String, Class, String)> {
        moved.iter().map(|m| (m.shown(), m.class(), m.detail())).collect()
    }
    fn row(path: &str, class: Class, detail: &str) -> (String, Class, String) {
        (path.to_string(), class, detail.to_string())
    }

    #[test]
    fn the_same_list_moved_nothing() {
        let tree = vec![file(b"a", b"1"), dir(b"d"), link(b"d/l", b"../a"), exec(b"run", b"x")];
        assert_eq!(diff(&tree, &tree), vec![]);
        assert_eq!(diff(&[], &[]), vec![]);
    }

    #[test]
    fn added_removed_and_changed_files_are_told_apart() {
        let before = vec![file(b"old.txt", b"bye"), dir(b"src"), file(b"src/main.rs", b"fn main() {}")];
        let after = vec![dir(b"src"), file(b"src/main.rs", b"fn main() { run() }"), file(b"src/new.rs", b"")];
        assert_eq!(
            shown(&diff(&before, &after)),
            vec![
                row("old.txt", Class::Removed, ""),
                row("src/main.rs", Class::Changed, "12 → 19 bytes"),
                row("src/new.rs", Class::Added, ""),
            ]
        );
    }

    #[test]
    fn a_same_size_edit_is_a_change() {
        let moved = diff(&[file(b"a", b"abc")], &[file(b"a", b"xyz")]);
        assert_eq!(shown(&moved), vec![row("a", Class::Changed, "same size, 3 bytes")]);
    }

    #[test]
    fn an_exec_bit_flip_is_a_mode_change_not_a_content_change() {
        let moved = diff(&[file(b"run.sh", b"echo")], &[exec(b"run.sh", b"echo")]);
        assert_eq!(shown(&moved), vec![row("run.sh", Class::ModeChanged, "now executable")]);
        let moved = diff(&[exec(b"run.sh", b"echo")], &[file(b"run.sh", b"echo hi")]);
        assert_eq!(
            shown(&moved),
            vec![row("run.sh", Class::ModeChanged, "no longer executable; contents changed too")]
        );
    }

    #[test]
    fn a_symlink_pointed_elsewhere_is_retargeted() {
        let moved = diff(&[link(b"current", b"v1")], &[link(b"current", b"v2")]);
        assert_eq!(shown(&moved), vec![row("current", Class::Retargeted, "v1 → v2")]);
    }

    #[test]
    fn a_file_that_became_a_directory_is_a_type_change_and_its_contents_are_added() {
        let before = vec![file(b"lib", b"x"), link(b"z", b"lib")];
        let after = vec![dir(b"lib"), file(b"lib/a.rs", b""), file(b"z", b"lib")];
        assert_eq!(
            shown(&diff(&before, &after)),
            vec![
                row("lib", Class::TypeChanged, "file → dir"),
                row("lib/a.rs", Class::Added, ""),
                row("z", Class::TypeChanged, "symlink → file"),
            ]
        );
    }

    #[test]
    fn a_new_folder_is_said_by_its_files_and_an_empty_one_by_itself() {
        // `d-x` sorts between `d` and `d/…`: the folder's own files still imply it.
        let before = vec![file(b"d-x", b"")];
        let after = vec![dir(b"d"), file(b"d-x", b""), dir(b"d/e"), file(b"d/e/f", b""), dir(b"empty")];
        assert_eq!(
            shown(&diff(&before, &after)),
            vec![row("d/e/f", Class::Added, ""), row("empty/", Class::Added, "")]
        );
        // Removed likewise.
        assert_eq!(
            shown(&diff(&after, &before)),
            vec![row("d/e/f", Class::Removed, ""), row("empty/", Class::Removed, "")]
        );
    }

    #[test]
    fn names_that_are_not_utf8_are_diffed_by_their_bytes() {
        let before = vec![file(b"caf\xe9", b"latin-1")];
        let after = vec![file(b"caf\xc3\xa9", b"utf-8")];
        assert_eq!(
            shown(&diff(&before, &after)),
            vec![row("café", Class::Added, ""), row("caf\\xe9", Class::Removed, "")]
        );
    }
}
