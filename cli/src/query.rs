//! The read commands — `status`, `logs`, `images`, `agents` — each one call to the coordinator
//! (re-asked on transport failure: they are idempotent reads), its answer shown and returned.

use std::io::Write;

use kiln_proto::v1::kiln_client::KilnClient;
use kiln_proto::v1::{AgentsRequest, ImagesRequest, LogsRequest, StatusRequest};
use serde::Serialize;

use crate::connect::{self, Kind};
use crate::embedded::{with_coordinator, with_reader};
use crate::error::CliError;
use crate::event::Event;
use crate::render::{renderer, OutputMode, Render};
use crate::view::{agents_text, images_text, status_text, AgentView, StatusView, StoreView};
use crate::Connect;

/// `kiln status [INSTANCE]`.
#[derive(Clone, Debug, Default)]
pub struct StatusArgs {
    /// `None`: every instance.
    pub instance: Option<String>,
    pub connect: Connect,
    pub output: OutputMode,
}

/// `kiln logs ID [--follow]`.
#[derive(Clone, Debug, Default)]
pub struct LogsArgs {
    pub converge_id: String,
    /// Keep streaming until the converge finishes.
    pub follow: bool,
    pub connect: Connect,
    pub output: OutputMode,
}

/// `kiln images`, `kiln agents`, `kiln pins`.
#[derive(Clone, Debug, Default)]
pub struct ListArgs {
    pub connect: Connect,
    pub output: OutputMode,
    /// `kiln images --all-farms`: every farm's Kiln images, not only this coordinator's.
    pub all_farms: bool,
}

/// The records and recent converges the coordinator holds.
pub async fn status(args: StatusArgs) -> Result<StatusView, CliError> {
    let request = StatusRequest { instance: args.instance.clone().unwrap_or_default() };
    let view: StatusView = with_reader(&args.connect, |link| async move {
        let client = KilnClient::new(link.channel.clone());
        let reply = connect::call(&link, "Status", Kind::Read, || {
            let (mut client, request) = (client.clone(), request.clone());
            async move { client.status(request).await }
        })
        .await?;
        Ok(StatusView::from(reply.into_inner()))
    })
    .await?;
    show(args.output, &view, |v| status_text(v, now_ms()))?;
    Ok(view)
}

/// Replays a converge's events with the renderer `kiln up` uses.
pub async fn logs(args: LogsArgs) -> Result<Vec<Event>, CliError> {
    let mut render = renderer(args.output);
    let events = logs_with(&args, render.as_mut()).await;
    render.finish().map_err(CliError::Output)?;
    events
}

/// [`logs`] through `render`.
pub async fn logs_with(args: &LogsArgs, render: &mut dyn Render) -> Result<Vec<Event>, CliError> {
    let request = LogsRequest { converge_id: args.converge_id.clone(), follow: args.follow };
    with_reader(&args.connect, |link| async move {
        let client = KilnClient::new(link.channel.clone());
        let response = connect::call(&link, "Logs", Kind::Read, || {
            let (mut client, request) = (client.clone(), request.clone());
            async move { client.logs(request).await }
        })
        .await?;
        let mut stream = response.into_inner();
        let mut events = Vec::new();
        loop {
            match stream.message().await {
                Ok(Some(wire)) => {
                    let event = Event::from(wire);
                    render.event(&event).map_err(CliError::Output)?;
                    events.push(event);
                }
                Ok(None) => return Ok(events),
                Err(status) => return Err(connect::refused_by(&link, "Logs", status)),
            }
        }
    })
    .await
}

/// What every image store an agent reported holds.
pub async fn images(args: ListArgs) -> Result<Vec<StoreView>, CliError> {
    let all_farms = args.all_farms;
    let stores: Vec<StoreView> = with_coordinator(&args.connect, true, |link| async move {
        let client = KilnClient::new(link.channel.clone());
        let reply = connect::call(&link, "Images", Kind::Read, || {
            let mut client = client.clone();
            async move { client.images(ImagesRequest { all_farms }).await }
        })
        .await?;
        Ok(reply.into_inner().stores.into_iter().map(StoreView::from).collect())
    })
    .await?;
    show(args.output, &stores, |s| images_text(s, all_farms))?;
    Ok(stores)
}

/// One line of the audit log, as `kiln audit` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AuditView {
    pub at_ms: u64,
    pub actor: String,
    pub action: String,
    pub target: String,
    pub address: String,
    pub outcome: String,
}

/// `kiln audit`: the audit log as the coordinator lets the caller read it (an admin every entry,
/// anyone else their own).
pub async fn audit(args: ListArgs, since_ms: u64) -> Result<Vec<AuditView>, CliError> {
    let entries: Vec<AuditView> = with_reader(&args.connect, |link| async move {
        let client = KilnClient::new(link.channel.clone());
        let reply = connect::call(&link, "Audit", Kind::Read, || {
            let mut client = client.clone();
            async move { client.audit(kiln_proto::v1::AuditRequest { since_ms }).await }
        })
        .await?;
        Ok(reply
            .into_inner()
            .entries
            .into_iter()
            .map(|e| AuditView {
                at_ms: e.at_ms,
                actor: e.actor,
                action: e.action,
                target: e.target,
                address: e.address,
                outcome: e.outcome,
            })
            .collect())
    })
    .await?;
    show(args.output, &entries, |entries| {
        let rows = entries.iter().map(|e| {
            vec![
                crate::view::age(now_ms(), e.at_ms),
                e.actor.clone(),
                e.action.clone(),
                e.target.clone(),
                if e.address.is_empty() { "-".into() } else { e.address.clone() },
                e.outcome.clone(),
            ]
        });
        if entries.is_empty() {
            "no audit entries\n".to_string()
        } else {
            crate::view::table(rows, "  ")
        }
    })?;
    Ok(entries)
}

/// `kiln whoami`: who the coordinator takes the caller for.
pub async fn whoami(args: ListArgs) -> Result<String, CliError> {
    let reply = with_reader(&args.connect, |link| async move {
        let client = KilnClient::new(link.channel.clone());
        let reply = connect::call(&link, "WhoAmI", Kind::Read, || {
            let mut client = client.clone();
            async move { client.who_am_i(kiln_proto::v1::WhoAmIRequest {}).await }
        })
        .await?;
        Ok(reply.into_inner())
    })
    .await?;
    let line = match reply.team.is_empty() {
        true => format!("{} ({})", reply.actor, reply.role),
        false => format!("{} ({}, team {})", reply.actor, reply.role, reply.team),
    };
    show(args.output, &line, |line| format!("{line}\n"))?;
    Ok(line)
}

/// The agents the coordinator knows, connected or not.
pub async fn agents(args: ListArgs) -> Result<Vec<AgentView>, CliError> {
    let agents: Vec<AgentView> = with_coordinator(&args.connect, true, |link| async move {
        let client = KilnClient::new(link.channel.clone());
        let reply = connect::call(&link, "Agents", Kind::Read, || {
            let mut client = client.clone();
            async move { client.agents(AgentsRequest {}).await }
        })
        .await?;
        Ok(reply.into_inner().agents.into_iter().map(AgentView::from).collect())
    })
    .await?;
    show(args.output, &agents, |a| agents_text(a, now_ms()))?;
    Ok(agents)
}

/// Prints `value` as `--json` (one document) or as `text` gives it; nothing when quiet.
pub(crate) fn show<T: Serialize + ?Sized>(
    mode: OutputMode,
    value: &T,
    text: impl FnOnce(&T) -> String,
) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    let written = match mode {
        OutputMode::Quiet => return Ok(()),
        OutputMode::Json => {
            serde_json::to_writer_pretty(&mut out, value).map_err(std::io::Error::from).and_then(|()| writeln!(out))
        }
        OutputMode::Auto | OutputMode::Plain => out.write_all(text(value).as_bytes()),
    };
    written.and_then(|()| out.flush()).map_err(CliError::Output)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
