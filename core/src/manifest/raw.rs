//! `kiln.toml` as TOML states it, before any rule is checked.
//!
//! Keys are checked against the known ones on the spanned document first, so an unknown key is
//! reported with its table (`[built.api]`) and the keys that table takes — serde's own message
//! names neither. Required keys are `Option` here and checked in `resolve`, for the same reason.

use std::collections::BTreeMap;
use std::ops::Range;

use serde::Deserialize;
use toml::de::DeTable;
use toml::Spanned;

use super::error::Problem;

pub(super) const TOP_KEYS: &[&str] = &["instance", "team", "platforms", "target", "built", "brought", "pinned", "root"];
pub(super) const TARGET_KEYS: &[&str] = &["kind", "registry", "cluster", "namespace", "mirror_registry"];
pub(super) const BUILT_KEYS: &[&str] = &["context", "dockerfile", "args", "target", "shared", "repository", "stage"];
pub(super) const STAGE_KEYS: &[&str] = &["run", "remove", "image_path"];
pub(super) const REF_KEYS: &[&str] = &["ref"];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawManifest {
    pub instance: Option<Spanned<String>>,
    pub team: Option<Spanned<String>>,
    pub platforms: Option<Spanned<Vec<Spanned<String>>>>,
    /// `platforms = "cluster"`: where that key stands. Read off the document before serde sees
    /// it, so a list keeps the spans of its entries.
    #[serde(skip)]
    pub platforms_from_cluster: Option<Range<usize>>,
    pub root: Option<Spanned<String>>,
    pub target: Option<Spanned<RawTarget>>,
    #[serde(default)]
    pub built: BTreeMap<Spanned<String>, Spanned<RawBuilt>>,
    #[serde(default)]
    pub brought: BTreeMap<Spanned<String>, Spanned<RawRef>>,
    #[serde(default)]
    pub pinned: BTreeMap<Spanned<String>, Spanned<RawRef>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTarget {
    pub kind: Option<Spanned<String>>,
    pub registry: Option<Spanned<String>>,
    pub cluster: Option<Spanned<String>>,
    pub namespace: Option<Spanned<String>>,
    pub mirror_registry: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBuilt {
    pub context: Option<Spanned<String>>,
    pub dockerfile: Option<Spanned<String>>,
    pub args: Option<Spanned<BTreeMap<String, String>>>,
    pub target: Option<Spanned<String>>,
    pub shared: Option<bool>,
    pub repository: Option<Spanned<String>>,
    pub stage: Option<Spanned<RawStage>>,
}

/// `stage = { run = […], remove = […], image_path = "…" }`; its shape is checked first
/// (`stage::check_shape`), so serde only meets the right types.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStage {
    pub run: Option<Spanned<Vec<Spanned<String>>>>,
    pub remove: Option<Spanned<Vec<Spanned<String>>>>,
    pub image_path: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRef {
    #[serde(rename = "ref")]
    pub reference: Option<Spanned<String>>,
}

/// Parses `text`; a syntax error, an unknown key or a value of the wrong type comes back with the
/// byte span it sits on.
pub(super) fn parse(text: &str) -> Result<RawManifest, (Option<Range<usize>>, Box<Problem>)> {
    let toml_error = |err: toml::de::Error| {
        let span = err.span();
        let key = span.clone().and_then(|s| text.get(s)).map(|k| k.trim_matches(['"', '\'']));
        let detail = match (err.message(), key) {
            // The parser's message does not say which key, and the line alone can hold several.
            ("duplicate key", Some(key)) => format!("key {key:?} appears twice — keep one"),
            (message, _) => message.to_string(),
        };
        (span, Box::new(Problem::Toml { detail }))
    };
    let mut document = DeTable::parse(text).map_err(toml_error)?;
    check_keys(document.get_ref())?;
    let named =
        document.get_ref().get("platforms").and_then(|v| v.get_ref().as_str().map(|s| (s.to_string(), v.span())));
    let mut from_cluster = None;
    if let Some((name, span)) = named {
        if name != "cluster" {
            return Err((Some(span), Box::new(Problem::PlatformsNamed { name })));
        }
        document.get_mut().remove("platforms");
        from_cluster = Some(span);
    }
    let mut raw = RawManifest::deserialize(toml::de::Deserializer::from(document)).map_err(toml_error)?;
    raw.platforms_from_cluster = from_cluster;
    Ok(raw)
}

/// Reports the unknown key (or `stage` of the wrong shape) that comes first in the file (the
/// document's maps are sorted by key, not by position).
fn check_keys(root: &DeTable<'_>) -> Result<(), (Option<Range<usize>>, Box<Problem>)> {
    let mut unknown = Vec::new();
    check_table(root, "at the top level", TOP_KEYS, &mut unknown);
    for (key, value) in root.iter() {
        let Some(table) = value.get_ref().as_table() else {
            continue;
        };
        match key.get_ref().as_ref() {
            "target" => check_table(table, "in [target]", TARGET_KEYS, &mut unknown),
            kind @ ("built" | "brought" | "pinned") => {
                let expected = if kind == "built" { BUILT_KEYS } else { REF_KEYS };
                for (name, entry) in table.iter() {
                    if let Some(entry) = entry.get_ref().as_table() {
                        let section = format!("in {}", section(kind, name.get_ref()));
                        check_table(entry, &section, expected, &mut unknown);
                        let stage = entry.iter().find(|(key, _)| kind == "built" && key.get_ref() == "stage");
                        if let Some((_, stage)) = stage {
                            super::stage::check_shape(name.get_ref(), stage, &mut unknown);
                        }
                    }
                }
            }
            _ => {}
        }
    }
    match unknown.into_iter().min_by_key(|(span, _)| span.start) {
        Some((span, problem)) => Err((Some(span), Box::new(problem))),
        None => Ok(()),
    }
}

fn check_table(
    table: &DeTable<'_>,
    section: &str,
    expected: &'static [&'static str],
    unknown: &mut Vec<(Range<usize>, Problem)>,
) {
    for (key, _) in table.iter() {
        if !expected.contains(&key.get_ref().as_ref()) {
            let problem =
                Problem::UnknownKey { key: key.get_ref().to_string(), section: section.to_string(), expected };
            unknown.push((key.span(), problem));
        }
    }
}

/// The name of a section's value for messages: `[built.api]`.
pub(super) fn section(kind: &str, name: &str) -> String {
    format!("[{kind}.{name}]")
}
