//! `kiln ps` (what the farm runs and queues now) and `kiln cancel ID`.

use kiln_proto::v1 as pb;
use kiln_proto::v1::kiln_client::KilnClient;
use serde::Serialize;

use crate::connect::{self, Kind};
use crate::embedded::with_coordinator;
use crate::error::CliError;
use crate::query::ListArgs;
use crate::view::table;

/// One running converge, as `kiln ps --json` prints it.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct PsConverge {
    pub converge_id: String,
    pub instance: String,
    pub owner: String,
    pub requested_by: String,
    pub started_ms: u64,
    pub tasks: Vec<PsTask>,
}

/// One build task: queued (with its place and estimated wait) or building on an agent.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct PsTask {
    pub image: String,
    pub reference: String,
    pub state: String,
    pub agent: String,
    /// How long it has been in this state.
    pub millis: u64,
    pub position: u32,
    pub wait_ms: u64,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct PsView {
    pub converges: Vec<PsConverge>,
    pub slots: u32,
    pub busy: u32,
}

impl From<pb::PsReply> for PsView {
    fn from(reply: pb::PsReply) -> PsView {
        let converges = reply
            .converges
            .into_iter()
            .map(|c| PsConverge {
                converge_id: c.converge_id,
                instance: c.instance,
                owner: c.owner,
                requested_by: c.requested_by,
                started_ms: c.started_ms,
                tasks: c
                    .tasks
                    .into_iter()
                    .map(|t| PsTask {
                        image: t.image,
                        reference: t.reference,
                        state: t.state,
                        agent: t.agent,
                        millis: t.millis,
                        position: t.position,
                        wait_ms: t.wait_ms,
                    })
                    .collect(),
            })
            .collect();
        PsView { converges, slots: reply.slots, busy: reply.busy }
    }
}

/// `kiln ps`.
pub async fn ps(args: ListArgs) -> Result<PsView, CliError> {
    let view: PsView = with_coordinator(&args.connect, true, |link| async move {
        let client = KilnClient::new(link.channel.clone());
        let reply = connect::call(&link, "Ps", Kind::Read, || {
            let mut client = client.clone();
            async move { client.ps(pb::PsRequest {}).await }
        })
        .await?;
        Ok(PsView::from(reply.into_inner()))
    })
    .await?;
    crate::query::show(args.output, &view, ps_text)?;
    Ok(view)
}

/// `kiln cancel ID`: the instance whose converge was cancelled.
pub async fn cancel(args: ListArgs, converge_id: String) -> Result<String, CliError> {
    let instance = with_coordinator(&args.connect, true, |link| async move {
        let client = KilnClient::new(link.channel.clone());
        let reply = connect::call(&link, "Cancel", Kind::Action, || {
            let (mut client, converge_id) = (client.clone(), converge_id.clone());
            async move { client.cancel(pb::CancelRequest { converge_id }).await }
        })
        .await?;
        Ok(reply.into_inner().instance)
    })
    .await?;
    let text = |i: &String| format!("cancelled the converge of {i}\n");
    crate::query::show(args.output, &instance, text)?;
    Ok(instance)
}

/// One line per task, its converge's columns repeated so the table greps.
pub fn ps_text(view: &PsView) -> String {
    let mut out = format!("slots: {} busy of {}\n", view.busy, view.slots);
    if view.converges.is_empty() {
        out.push_str("no converge is running\n");
        return out;
    }
    let header = ["CONVERGE", "INSTANCE", "OWNER", "IMAGE", "STATE", "AGENT", "FOR"];
    let mut rows = vec![header.iter().map(|h| h.to_string()).collect::<Vec<_>>()];
    for c in &view.converges {
        if c.tasks.is_empty() {
            let row = [&c.converge_id, &c.instance, &c.owner, "-", "deciding or delivering", "-", "-"];
            rows.push(row.iter().map(|s| s.to_string()).collect());
        }
        for t in &c.tasks {
            let state = match t.state.as_str() {
                "queued" => format!("queued ({}, ~{} s)", kiln_core::ordinal(t.position), (t.wait_ms / 1000).max(1)),
                other => other.to_string(),
            };
            let agent = if t.agent.is_empty() { "-".to_string() } else { t.agent.clone() };
            let secs = format!("{} s", t.millis / 1000);
            rows.push(vec![
                c.converge_id.clone(),
                c.instance.clone(),
                c.owner.clone(),
                t.image.clone(),
                state,
                agent,
                secs,
            ]);
        }
    }
    out.push_str(&table(rows.into_iter(), ""));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queued_task_shows_its_place_and_wait() {
        let task = |image: &str, state: &str, agent: &str, position| PsTask {
            image: image.into(),
            reference: String::new(),
            state: state.into(),
            agent: agent.into(),
            millis: 3_000,
            position,
            wait_ms: 20_000,
        };
        let view = PsView {
            converges: vec![PsConverge {
                converge_id: "c-1".into(),
                instance: "shop".into(),
                owner: "team:payments".into(),
                requested_by: "user:alice".into(),
                started_ms: 0,
                tasks: vec![task("api", "building", "build-1", 0), task("web", "queued", "", 3)],
            }],
            slots: 4,
            busy: 4,
        };
        let text = ps_text(&view);
        assert!(text.starts_with("slots: 4 busy of 4\n"), "{text}");
        assert!(text.contains("api    building"), "{text}");
        assert!(text.contains("web    queued (3rd, ~20 s)  -"), "{text}");
    }
}
