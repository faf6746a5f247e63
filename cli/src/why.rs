//! `kiln why IMAGE [DIR] [--since N]`: everything that moved between a built image's recorded
//! generation and its inputs now — every file by how it moved (added, removed, changed, mode
//! changed, type changed, symlink retargeted), and the Dockerfile, build args, target stage,
//! platforms and delivery.
//!
//! The CLI walks and addresses the instance exactly as `kiln up` would (staging included), and
//! `Kiln.Why` compares those inputs with the recorded ones by the converge's own rule. The files
//! are diffed here, against the recorded tree's entry list the coordinator kept: its list is small
//! to send, while ours would be the whole tree. The list is trusted only if it hashes to the
//! recorded tree digest. Nothing is diffed when nothing moved.

use std::path::PathBuf;

use kiln_core::digest::diff::{diff, Class, Moved};
use kiln_core::digest::{list, Entry, TreeDigest};
use kiln_core::manifest::Manifest;
use kiln_proto::v1::kiln_client::KilnClient;
use kiln_proto::v1::{input_change, reason, WhyReply, WhyRequest};
use serde::Serialize;

use crate::connect::{self, Kind};
use crate::embedded::with_reader;
use crate::error::CliError;
use crate::query::show;
use crate::render::OutputMode;
use crate::Connect;

/// What `kiln why` is asked.
#[derive(Clone, Debug)]
pub struct WhyArgs {
    /// The built image's name in the manifest.
    pub image: String,
    /// The instance folder holding `kiln.toml`.
    pub dir: PathBuf,
    /// Compare with this generation (one the record keeps) instead of the current one.
    pub since: Option<u64>,
    pub connect: Connect,
    pub output: OutputMode,
}

/// What moved, as `--json` prints it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WhyView {
    pub instance: String,
    pub image: String,
    /// The generation compared against.
    pub generation: u64,
    /// The ref that generation recorded for the image (empty when it names none).
    pub reference: String,
    /// That generation does not name the image: its next converge is a first build.
    pub first_build: bool,
    /// Whether any input moved.
    pub moved: bool,
    pub changes: Vec<ChangeView>,
}

/// One input that moved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChangeView {
    /// `context`, `dockerfile`, `build_arg`, `target`, `platforms`, `delivery`.
    pub input: &'static str,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    pub before: String,
    pub after: String,
    /// The coordinator's words for it (`build arg VERSION: 1 → 2`).
    pub words: String,
    /// `context`: every path that moved, by how.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub files: Option<FileDiff>,
    /// `context`: why the files cannot be named, when they cannot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub files_unknown: Option<String>,
}

/// Every path that moved, by class; each list in path order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Default)]
pub struct FileDiff {
    pub added: Vec<FileMove>,
    pub removed: Vec<FileMove>,
    pub changed: Vec<FileMove>,
    pub mode_changed: Vec<FileMove>,
    pub type_changed: Vec<FileMove>,
    pub retargeted: Vec<FileMove>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FileMove {
    pub path: String,
    /// `120 → 164 bytes`, `now executable`, `file → dir`, `v1 → v2`; absent for added and removed.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

impl FileDiff {
    fn of(moved: &[Moved]) -> FileDiff {
        let mut files = FileDiff::default();
        for m in moved {
            files.class_mut(m.class()).push(FileMove { path: m.shown(), detail: m.detail() });
        }
        files
    }

    fn class_mut(&mut self, class: Class) -> &mut Vec<FileMove> {
        match class {
            Class::Added => &mut self.added,
            Class::Removed => &mut self.removed,
            Class::Changed => &mut self.changed,
            Class::ModeChanged => &mut self.mode_changed,
            Class::TypeChanged => &mut self.type_changed,
            Class::Retargeted => &mut self.retargeted,
        }
    }

    fn class(&self, class: Class) -> &[FileMove] {
        match class {
            Class::Added => &self.added,
            Class::Removed => &self.removed,
            Class::Changed => &self.changed,
            Class::ModeChanged => &self.mode_changed,
            Class::TypeChanged => &self.type_changed,
            Class::Retargeted => &self.retargeted,
        }
    }

    pub fn count(&self) -> usize {
        Class::ALL.iter().map(|&c| self.class(c).len()).sum()
    }
}

/// `kiln why`: shows what moved and returns it.
pub async fn why(args: WhyArgs) -> Result<WhyView, CliError> {
    let dir = args.dir.clone();
    let manifest = tokio::task::spawn_blocking(move || Manifest::load(&dir))
        .await
        .map_err(|_| CliError::Panicked { what: "manifest" })??;
    let built: Vec<String> = manifest.built().map(|(name, _)| name.to_string()).collect();
    if !built.contains(&args.image) {
        let file = args.dir.join("kiln.toml");
        return Err(CliError::NoSuchImage { image: args.image.clone(), file, built: built.join(", ") });
    }
    let instance = manifest.instance.clone();
    let stat_cache = crate::home::stat_cache_dir(args.connect.coordinator.is_none(), args.connect.kiln_home.as_deref());
    let (image, since) = (args.image.clone(), args.since.unwrap_or(0));
    let (request, now) = tokio::task::spawn_blocking(move || address(&manifest, &image, since, stat_cache.as_deref()))
        .await
        .map_err(|_| CliError::Panicked { what: "walk" })??;
    let reply = with_reader(&args.connect, |link| async move {
        let client = KilnClient::new(link.channel.clone());
        let reply = connect::call(&link, "Why", Kind::Read, || {
            let (mut client, request) = (client.clone(), request.clone());
            async move { client.why(request).await }
        })
        .await?;
        Ok(reply.into_inner())
    })
    .await?;
    let view = view_of(instance, args.image.clone(), reply, &now);
    show(args.output, &view, why_text)?;
    Ok(view)
}

/// Walks and addresses the manifest as `kiln up` does, and asks about `image`: its request, and
/// its context's entries as walked now.
fn address(
    manifest: &Manifest,
    image: &str,
    generation: u64,
    stat_cache: Option<&std::path::Path>,
) -> Result<(WhyRequest, Vec<Entry>), CliError> {
    let mut walked = crate::request::walk_built_keeping_trees(manifest, stat_cache)?;
    let done = manifest.address(&walked.trees())?.into_iter().find(|a| a.name == image);
    let spec = crate::request::wire_built(done.expect("a built image of the manifest is addressed"));
    let tree = walked.contexts.remove(image).and_then(|c| c.tree).map(|t| t.entries).unwrap_or_default();
    let request = WhyRequest {
        instance: manifest.instance.clone(),
        image: Some(spec),
        platforms: manifest.platforms.iter().map(|p| p.oci()).collect(),
        target: Some(crate::request::wire_target(manifest)),
        generation,
    };
    Ok((request, tree))
}

fn view_of(instance: String, image: String, reply: WhyReply, now: &[Entry]) -> WhyView {
    let reason = reply.reason.unwrap_or_default();
    let first_build = reason.kind() == reason::Kind::FirstBuild;
    let changes: Vec<ChangeView> = reason
        .changes
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let input = input_word(c.input());
            let mut view = ChangeView {
                input,
                words: reply.words.get(i).cloned().unwrap_or_default(),
                name: c.name,
                before: c.before,
                after: c.after,
                files: None,
                files_unknown: None,
            };
            if input == "context" {
                match recorded_entries(&reply.entries, &view.before, reply.generation) {
                    Ok(before) => view.files = Some(FileDiff::of(&diff(&before, now))),
                    Err(why) => view.files_unknown = Some(why),
                }
            }
            view
        })
        .collect();
    WhyView {
        instance,
        image,
        generation: reply.generation,
        reference: reply.reference,
        first_build,
        moved: first_build || !changes.is_empty(),
        changes,
    }
}

/// The recorded tree's entries, or why they cannot be had.
fn recorded_entries(stream: &[u8], before: &str, generation: u64) -> Result<Vec<Entry>, String> {
    if stream.is_empty() {
        return Err(format!(
            "the coordinator kept no entry list of generation {generation}'s context (uploaded before Kiln kept \
             them, never uploaded to this farm, or too long to keep); the next converge keeps one"
        ));
    }
    let digest: TreeDigest = before.parse().map_err(|e: kiln_core::digest::DigestParseError| e.to_string())?;
    list::decode_for(stream, &digest).map_err(|e| e.to_string())
}

fn input_word(input: input_change::Input) -> &'static str {
    use input_change::Input;
    match input {
        Input::Context => "context",
        Input::Dockerfile => "dockerfile",
        Input::BuildArg => "build_arg",
        Input::Target => "target",
        Input::Platforms => "platforms",
        Input::Delivery => "delivery",
        Input::Unspecified => "unknown",
    }
}

/// The text `kiln why` prints.
pub fn why_text(view: &WhyView) -> String {
    let (image, generation) = (&view.image, view.generation);
    if view.first_build {
        return format!(
            "{image}: generation {generation} of {} does not name it — its next converge is a first build\n",
            view.instance
        );
    }
    if !view.moved {
        return format!("{image}: nothing moved since generation {generation} ({})\n", view.reference);
    }
    let mut out = format!("{image}: moved since generation {generation} ({}):\n", view.reference);
    for change in &view.changes {
        match (&change.files, &change.files_unknown) {
            (Some(files), _) => {
                let n = files.count();
                out.push_str(&format!("  context: {n} {}\n", if n == 1 { "file" } else { "files" }));
                for class in Class::ALL {
                    let moved = files.class(class);
                    if moved.is_empty() {
                        continue;
                    }
                    out.push_str(&format!("    {}:\n", class.heading()));
                    for m in moved {
                        let detail = if m.detail.is_empty() { String::new() } else { format!(" ({})", m.detail) };
                        out.push_str(&format!("      {} {}{detail}\n", class.mark(), m.path));
                    }
                }
            }
            (None, Some(why)) => out.push_str(&format!("  {} — {why}\n", change.words)),
            (None, None) => out.push_str(&format!("  {}\n", change.words)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(changes: Vec<ChangeView>) -> WhyView {
        WhyView {
            instance: "shop".into(),
            image: "web".into(),
            generation: 4,
            reference: "shop-web:4a77b1c2d3e4-amd64".into(),
            first_build: false,
            moved: !changes.is_empty(),
            changes,
        }
    }

    fn change(input: &'static str, words: &str) -> ChangeView {
        let (name, before, after) = (String::new(), String::new(), String::new());
        ChangeView { input, name, before, after, words: words.into(), files: None, files_unknown: None }
    }

    #[test]
    fn nothing_moved_says_so_in_one_line() {
        assert_eq!(why_text(&view(vec![])), "web: nothing moved since generation 4 (shop-web:4a77b1c2d3e4-amd64)\n");
    }

    #[test]
    fn every_file_is_listed_under_how_it_moved_then_the_other_inputs() {
        let move_ = |path: &str, detail: &str| FileMove { path: path.into(), detail: detail.into() };
        let files = FileDiff {
            added: vec![move_("src/new.rs", "")],
            removed: vec![move_("old.txt", "")],
            changed: vec![move_("src/main.rs", "12 → 19 bytes")],
            mode_changed: vec![move_("run.sh", "now executable")],
            type_changed: vec![move_("lib", "file → dir")],
            retargeted: vec![move_("current", "v1 → v2")],
        };
        let context = ChangeView { files: Some(files), ..change("context", "context changed: 6 files (…)") };
        let text = why_text(&view(vec![context, change("build_arg", "build arg VERSION: 1 → 2")]));
        assert_eq!(
            text,
            "web: moved since generation 4 (shop-web:4a77b1c2d3e4-amd64):\n\
             \x20 context: 6 files\n\
             \x20   added:\n\
             \x20     + src/new.rs\n\
             \x20   removed:\n\
             \x20     − old.txt\n\
             \x20   changed:\n\
             \x20     ~ src/main.rs (12 → 19 bytes)\n\
             \x20   mode changed:\n\
             \x20     ~ run.sh (now executable)\n\
             \x20   type changed:\n\
             \x20     ~ lib (file → dir)\n\
             \x20   symlink retargeted:\n\
             \x20     ~ current (v1 → v2)\n\
             \x20 build arg VERSION: 1 → 2\n"
        );
    }

    #[test]
    fn a_list_that_is_not_the_recorded_trees_is_never_diffed() {
        let entries = vec![Entry {
            path: b"a".to_vec(),
            kind: kiln_core::digest::EntryKind::Dir,
            size: 0,
            link_target: vec![],
            stat: None,
            hash: None,
        }];
        let stream = list::encode(&entries).unwrap();
        let other = "0".repeat(64);
        let err = recorded_entries(&stream, &other, 3).unwrap_err();
        assert!(err.contains("stored under the wrong digest"), "{err}");
        let missing = recorded_entries(&[], &other, 3).unwrap_err();
        assert!(missing.contains("kept no entry list of generation 3"), "{missing}");
    }
}
