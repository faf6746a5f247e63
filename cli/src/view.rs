//! What `status`, `images` and `agents` show: the wire replies converted into plain structs that
//! serialize as the `--json` output, and their text tables. The text is a pure function of the
//! view and "now", so it is tested without a coordinator or a clock.

use std::collections::BTreeMap;

use kiln_proto::v1::{image_spec, AgentInfo, ConvergeSummary, InstanceStatus, Role, StatusReply, StoreImages};
use serde::Serialize;

use crate::event::Outcome;
use crate::render::{human_bytes, seconds};

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StatusView {
    pub instances: Vec<InstanceView>,
    /// Most recent first, as the coordinator lists them.
    pub converges: Vec<ConvergeView>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct InstanceView {
    pub instance: String,
    pub generation: u64,
    pub written_at_ms: u64,
    pub images: Vec<RecordedView>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RecordedView {
    pub name: String,
    pub reference: String,
    /// `built`, `brought` or `pinned`.
    pub kind: &'static str,
    pub target: String,
    /// The `USER` a built image declares, read from its image config when it was built (so a
    /// deployment can be checked against it without pulling); `None` when it declares none, and
    /// always for brought and pinned refs, which are never inspected (ADR-0037).
    pub user: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ConvergeView {
    pub id: String,
    pub instance: String,
    pub outcome: Outcome,
    pub reason: String,
    pub started_ms: u64,
    pub finished_ms: u64,
    pub requested_by: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StoreView {
    pub store: String,
    pub agent: String,
    /// Set when the agent could not list this store; `images` is then empty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub images: Vec<ImageView>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ImageView {
    pub id: String,
    pub refs: Vec<String>,
    pub digests: Vec<String>,
    pub bytes: u64,
    pub labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AgentView {
    pub id: String,
    /// `host`, `node`, `both`, or `unknown`.
    pub role: &'static str,
    pub stores: Vec<String>,
    pub platforms: Vec<String>,
    /// Platforms it runs through emulation; known while it is connected.
    pub emulates: Vec<String>,
    pub version: String,
    pub connected: bool,
    /// Connected, but it said it is going away: it finishes what it runs and takes nothing new.
    pub draining: bool,
    pub last_seen_ms: u64,
}

impl From<StatusReply> for StatusView {
    fn from(reply: StatusReply) -> StatusView {
        StatusView {
            instances: reply.instances.into_iter().map(InstanceView::from).collect(),
            converges: reply.converges.into_iter().map(ConvergeView::from).collect(),
        }
    }
}

impl From<InstanceStatus> for InstanceView {
    fn from(s: InstanceStatus) -> InstanceView {
        let images = s
            .images
            .into_iter()
            .map(|i| RecordedView {
                kind: match image_spec::Kind::try_from(i.kind) {
                    Ok(image_spec::Kind::Built) => "built",
                    Ok(image_spec::Kind::Brought) => "brought",
                    Ok(image_spec::Kind::Pinned) => "pinned",
                    _ => "unknown",
                },
                name: i.name,
                reference: i.reference,
                target: i.target,
                user: i.declares_user.then_some(i.user),
            })
            .collect();
        InstanceView { instance: s.instance, generation: s.generation, written_at_ms: s.written_at_ms, images }
    }
}

impl From<ConvergeSummary> for ConvergeView {
    fn from(c: ConvergeSummary) -> ConvergeView {
        ConvergeView {
            outcome: Outcome::from_wire(c.outcome),
            id: c.id,
            instance: c.instance,
            reason: c.reason,
            started_ms: c.started_ms,
            finished_ms: c.finished_ms,
            requested_by: c.requested_by,
        }
    }
}

impl From<StoreImages> for StoreView {
    fn from(s: StoreImages) -> StoreView {
        let images = s
            .images
            .into_iter()
            .map(|i| ImageView {
                id: i.id,
                refs: i.refs,
                digests: i.digests,
                bytes: i.bytes,
                labels: i.labels.into_iter().collect(),
            })
            .collect();
        StoreView { store: s.store, agent: s.agent, error: Some(s.error).filter(|e| !e.is_empty()), images }
    }
}

impl From<AgentInfo> for AgentView {
    fn from(a: AgentInfo) -> AgentView {
        AgentView {
            role: match Role::try_from(a.role) {
                Ok(Role::Host) => "host",
                Ok(Role::Node) => "node",
                Ok(Role::Both) => "both",
                _ => "unknown",
            },
            id: a.id,
            stores: a.stores,
            platforms: a.platforms,
            emulates: a.emulates,
            version: a.version,
            connected: a.connected,
            draining: a.draining,
            last_seen_ms: a.last_seen_ms,
        }
    }
}

/// `kiln status` as text.
pub fn status_text(view: &StatusView, now_ms: u64) -> String {
    let mut out = String::new();
    if view.instances.is_empty() {
        out.push_str("no instance has a record yet — `kiln up` in an instance folder makes one\n");
    }
    for instance in &view.instances {
        out.push_str(&format!(
            "{}  generation {}, written {}\n",
            instance.instance,
            instance.generation,
            age(now_ms, instance.written_at_ms)
        ));
        let rows = instance.images.iter().map(|i| {
            // Only a built image was inspected; for a brought or pinned one Kiln knows nothing.
            let user = match (&i.user, i.kind) {
                (Some(user), _) => format!("USER {user}"),
                (None, "built") => "no USER".to_string(),
                (None, _) => String::new(),
            };
            vec![i.name.clone(), i.kind.to_string(), i.reference.clone(), user]
        });
        out.push_str(&table(rows, "  "));
    }
    if !view.converges.is_empty() {
        out.push_str("\nrecent converges\n");
        let rows = view.converges.iter().map(|c| {
            let took = match c.finished_ms.checked_sub(c.started_ms) {
                Some(ms) if c.finished_ms > 0 => seconds(ms),
                _ => "-".to_string(),
            };
            vec![
                c.id.clone(),
                c.instance.clone(),
                c.outcome.word().to_string(),
                took,
                c.requested_by.clone(),
                age(now_ms, c.started_ms),
                c.reason.clone(),
            ]
        });
        out.push_str(&table(rows, "  "));
    }
    out
}

/// `kiln images` as text: per store, one row per image.
/// `kiln images` as text; with every farm's images, a farm column says whose each is.
pub fn images_text(stores: &[StoreView], all_farms: bool) -> String {
    let mut out = String::new();
    if stores.is_empty() {
        out.push_str("no store is known — no agent has connected\n");
    }
    for store in stores {
        match &store.error {
            Some(error) => {
                out.push_str(&format!("store {} (agent {}): listing failed: {error}\n", store.store, store.agent))
            }
            None => out.push_str(&format!(
                "store {} (agent {}): {} image(s)\n",
                store.store,
                store.agent,
                store.images.len()
            )),
        }
        let rows = store.images.iter().map(|i| {
            let label = |key: &str| i.labels.get(key).cloned().unwrap_or_else(|| "-".to_string());
            let refs = if i.refs.is_empty() { "<none>".to_string() } else { i.refs.join(", ") };
            let mut row = vec![
                refs,
                short_id(&i.id),
                human_bytes(i.bytes),
                format!("kind={}", label("kiln.dev/kind")),
                format!("instance={}", label("kiln.dev/instance")),
            ];
            if all_farms {
                row.push(format!("farm={}", label("kiln.dev/farm")));
            }
            row
        });
        out.push_str(&table(rows, "  "));
    }
    out
}

/// `kiln agents` as text: one row per agent.
pub fn agents_text(agents: &[AgentView], now_ms: u64) -> String {
    if agents.is_empty() {
        return "no agent has connected\n".to_string();
    }
    let header = ["AGENT", "ROLE", "STORES", "PLATFORMS", "VERSION", "CONNECTED", "LAST SEEN"];
    let rows = std::iter::once(header.iter().map(|h| h.to_string()).collect()).chain(agents.iter().map(|a| {
        vec![
            a.id.clone(),
            a.role.to_string(),
            join_or_dash(&a.stores),
            match a.emulates.is_empty() {
                true => join_or_dash(&a.platforms),
                false => format!("{} (emulates {})", join_or_dash(&a.platforms), a.emulates.join(",")),
            },
            a.version.clone(),
            match (a.connected, a.draining) {
                (true, false) => "yes",
                (true, true) => "draining",
                (false, _) => "no",
            }
            .to_string(),
            age(now_ms, a.last_seen_ms),
        ]
    }));
    table(rows, "")
}

fn join_or_dash(items: &[String]) -> String {
    if items.is_empty() {
        "-".to_string()
    } else {
        items.join(",")
    }
}

/// `sha256:<first 12 hex>` as `docker images` shortens ids.
fn short_id(id: &str) -> String {
    let hex = id.strip_prefix("sha256:").unwrap_or(id);
    hex.chars().take(12).collect()
}

/// How long before `now_ms` the time `then_ms` was; `-` for an unknown (zero) time.
pub fn age(now_ms: u64, then_ms: u64) -> String {
    if then_ms == 0 {
        return "-".to_string();
    }
    let secs = now_ms.saturating_sub(then_ms) / 1000;
    match secs {
        0 => "just now".to_string(),
        1..=59 => format!("{secs} s ago"),
        60..=3599 => format!("{} min ago", secs / 60),
        3600..=86_399 => format!("{} h ago", secs / 3600),
        _ => format!("{} d ago", secs / 86_400),
    }
}

/// Rows with their columns aligned, each line starting with `indent`; trailing spaces trimmed.
pub(crate) fn table(rows: impl Iterator<Item = Vec<String>>, indent: &str) -> String {
    let rows: Vec<Vec<String>> = rows.collect();
    let mut widths: Vec<usize> = Vec::new();
    for row in &rows {
        for (i, cell) in row.iter().enumerate() {
            let w = cell.chars().count();
            match widths.get_mut(i) {
                Some(width) => *width = (*width).max(w),
                None => widths.push(w),
            }
        }
    }
    let mut out = String::new();
    for row in &rows {
        let mut line = indent.to_string();
        for (i, cell) in row.iter().enumerate() {
            line.push_str(cell);
            if i + 1 < row.len() {
                line.push_str(&" ".repeat(widths[i] - cell.chars().count() + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_700_000_600_000;

    #[test]
    fn status_lists_each_record_then_the_recent_converges() {
        let view = StatusView {
            instances: vec![InstanceView {
                instance: "hello".into(),
                generation: 3,
                written_at_ms: NOW - 300_000,
                images: vec![
                    RecordedView {
                        name: "web".into(),
                        reference: "hello-web:17eb17246f39-amd64".into(),
                        kind: "built",
                        target: "local".into(),
                        user: Some("1000:1000".into()),
                    },
                    RecordedView {
                        name: "worker".into(),
                        reference: "hello-worker:a0c3e1d2f4b5-amd64".into(),
                        kind: "built",
                        target: "local".into(),
                        user: None,
                    },
                    RecordedView {
                        name: "shell".into(),
                        reference: "busybox:1.36".into(),
                        kind: "brought",
                        target: "local".into(),
                        user: None,
                    },
                ],
            }],
            converges: vec![
                ConvergeView {
                    id: "c-18".into(),
                    instance: "hello".into(),
                    outcome: Outcome::Failed,
                    reason: "worker: build failed".into(),
                    started_ms: NOW - 7_200_000,
                    finished_ms: NOW - 7_199_000,
                    requested_by: "ana@box".into(),
                },
                ConvergeView {
                    id: "c-17".into(),
                    instance: "hello".into(),
                    outcome: Outcome::Succeeded,
                    reason: String::new(),
                    started_ms: NOW - 305_000,
                    finished_ms: NOW - 301_800,
                    requested_by: "ana@box".into(),
                },
            ],
        };
        let golden = "\
hello  generation 3, written 5 min ago
  web     built    hello-web:17eb17246f39-amd64     USER 1000:1000
  worker  built    hello-worker:a0c3e1d2f4b5-amd64  no USER
  shell   brought  busybox:1.36

recent converges
  c-18  hello  failed     1.0 s  ana@box  2 h ago    worker: build failed
  c-17  hello  succeeded  3.2 s  ana@box  5 min ago
";
        assert_eq!(status_text(&view, NOW), golden);
        assert!(status_text(&StatusView::default(), NOW).starts_with("no instance has a record yet"));
    }

    #[test]
    fn images_show_refs_short_id_size_and_kiln_labels_per_store() {
        let stores = vec![
            StoreView {
                store: "docker:box".into(),
                agent: "embedded-box".into(),
                error: None,
                images: vec![
                    ImageView {
                        id: format!("sha256:{}", "0123456789ab".repeat(5)),
                        refs: vec!["hello-web:17eb17246f39-amd64".into()],
                        digests: vec![],
                        bytes: 2_100_000,
                        labels: BTreeMap::from([
                            ("kiln.dev/kind".into(), "image".into()),
                            ("kiln.dev/instance".into(), "hello".into()),
                        ]),
                    },
                    ImageView {
                        id: "sha256:ffffffffffff00".into(),
                        refs: vec![],
                        digests: vec![],
                        bytes: 512,
                        labels: BTreeMap::new(),
                    },
                ],
            },
            StoreView {
                store: "containerd:n1".into(),
                agent: "n1".into(),
                error: Some("socket gone".into()),
                images: vec![],
            },
        ];
        let golden = "\
store docker:box (agent embedded-box): 2 image(s)
  hello-web:17eb17246f39-amd64  0123456789ab  2.1 MB  kind=image  instance=hello
  <none>                        ffffffffffff  512 B   kind=-      instance=-
store containerd:n1 (agent n1): listing failed: socket gone
";
        assert_eq!(images_text(&stores, false), golden);
    }

    #[test]
    fn agents_show_one_aligned_row_each_and_a_draining_one_as_draining() {
        let agent = |id: &str, connected, draining| AgentView {
            id: id.into(),
            role: "host",
            stores: vec!["docker:box".into()],
            platforms: vec!["linux/amd64".into()],
            emulates: match id {
                "leaving" => vec!["linux/arm64".into(), "linux/riscv64".into()],
                _ => vec![],
            },
            version: "0.1.0".into(),
            connected,
            draining,
            last_seen_ms: NOW - 2_000,
        };
        let agents =
            vec![agent("embedded-box", true, false), agent("leaving", true, true), agent("gone", false, false)];
        let golden = "\
AGENT         ROLE  STORES      PLATFORMS                                         VERSION  CONNECTED  LAST SEEN
embedded-box  host  docker:box  linux/amd64                                       0.1.0    yes        2 s ago
leaving       host  docker:box  linux/amd64 (emulates linux/arm64,linux/riscv64)  0.1.0    draining   2 s ago
gone          host  docker:box  linux/amd64                                       0.1.0    no         2 s ago
";
        assert_eq!(agents_text(&agents, NOW), golden);
    }

    #[test]
    fn json_views_carry_the_wire_fields() {
        let view =
            StoreView::from(StoreImages { store: "s".into(), agent: "a".into(), images: vec![], error: String::new() });
        assert_eq!(serde_json::to_string(&view).unwrap(), r#"{"store":"s","agent":"a","images":[]}"#);
        let agent = AgentView::from(AgentInfo {
            id: "x".into(),
            role: Role::Both as i32,
            connected: true,
            draining: true,
            ..Default::default()
        });
        assert_eq!(
            serde_json::to_string(&agent).unwrap(),
            r#"{"id":"x","role":"both","stores":[],"platforms":[],"emulates":[],"version":"","connected":true,"draining":true,"last_seen_ms":0}"#
        );
        let recorded = |user: &str, declares_user| kiln_proto::v1::RecordedImage {
            name: "web".into(),
            kind: image_spec::Kind::Built as i32,
            user: user.into(),
            declares_user,
            ..Default::default()
        };
        let status = |images| InstanceView::from(InstanceStatus { images, ..Default::default() });
        let json = serde_json::to_value(status(vec![recorded("1000:1000", true), recorded("", false)])).unwrap();
        assert_eq!(json["images"][0]["user"], "1000:1000");
        assert_eq!(json["images"][1]["user"], serde_json::Value::Null, "no USER is null, never \"\"");
    }
}
