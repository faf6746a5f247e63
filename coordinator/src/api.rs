//! The CLI-facing `Kiln` service: `Up` opens a converge and streams its events; `Status`, `Logs`,
//! `Images` and `Agents` read state. A converge runs to its end even if its client goes away.

use crate::engine::{now_ms, Engine};
use crate::events::{to_pb, Events};
use crate::model::{ConvergeState, EventKind};
use crate::plan::UpPlan;
use crate::store::StoreError;
use kiln_proto::v1 as pb;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// The `Kiln` gRPC service.
#[derive(Debug, Clone)]
pub struct KilnService {
    pub engine: Arc<Engine>,
}

fn store_status(err: StoreError) -> Status {
    match err {
        StoreError::ConvergeRunning { .. } => Status::aborted(kiln_core::error_chain(&err)),
        StoreError::UnknownConverge { .. } => Status::not_found(kiln_core::error_chain(&err)),
        other => Status::internal(kiln_core::error_chain(&other)),
    }
}

type EventStream = ReceiverStream<Result<pb::ConvergeEvent, Status>>;

#[tonic::async_trait]
impl pb::kiln_server::Kiln for KilnService {
    type UpStream = EventStream;

    async fn up(&self, request: Request<pb::UpRequest>) -> Result<Response<EventStream>, Status> {
        let plan = UpPlan::try_from(request.into_inner())?;
        let engine = self.engine.clone();
        let converge = engine.store.open_converge(&plan.instance, &plan.requested_by).await.map_err(store_status)?;
        let (live, rx) = mpsc::channel(256);
        let id = converge.id.clone();
        tokio::spawn(async move {
            let (events, writer) = Events::start(engine.store.clone(), id.clone(), live);
            events.emit(EventKind::Started, None, "");
            let result = engine.up(&id, &plan, &events).await;
            if let Err(err) = engine.store.release_claims(&id).await {
                tracing::warn!(converge = %id, error = %err, "claims not released; they expire on their lease");
            }
            let state = match result {
                Ok(generation) => {
                    events.emit(
                        EventKind::Finished { succeeded: true },
                        None,
                        format!("{} at generation {generation}", plan.instance),
                    );
                    ConvergeState::Succeeded
                }
                Err(failure) => {
                    events.emit(EventKind::Failed, failure.image.as_deref(), failure.reason.clone());
                    events.emit(EventKind::Finished { succeeded: false }, None, failure.reason.clone());
                    ConvergeState::Failed { reason: failure.reason }
                }
            };
            drop(events);
            let _ = writer.await;
            if let Err(err) = engine.store.finish_converge(&id, state).await {
                tracing::warn!(converge = %id, error = %err, "converge not marked finished");
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type DownStream = EventStream;

    async fn down(&self, _request: Request<pb::DownRequest>) -> Result<Response<EventStream>, Status> {
        Err(Status::unimplemented("`kiln down` arrives with the sweep across hosts and nodes"))
    }

    type GcStream = EventStream;

    async fn gc(&self, _request: Request<pb::GcRequest>) -> Result<Response<EventStream>, Status> {
        Err(Status::unimplemented("`kiln gc` arrives with the sweep across hosts and nodes"))
    }

    async fn status(&self, request: Request<pb::StatusRequest>) -> Result<Response<pb::StatusReply>, Status> {
        let want = request.into_inner().instance;
        let store = &self.engine.store;
        let mut instances = Vec::new();
        for (record, _) in store.records().await.map_err(store_status)? {
            if !want.is_empty() && record.instance != want {
                continue;
            }
            let images = record
                .images
                .iter()
                .map(|ri| pb::RecordedImage {
                    name: ri.name.clone(),
                    reference: ri.reference.clone(),
                    kind: match ri.kind {
                        crate::model::RecordedKind::Built => pb::image_spec::Kind::Built,
                        crate::model::RecordedKind::Brought => pb::image_spec::Kind::Brought,
                        crate::model::RecordedKind::Pinned => pb::image_spec::Kind::Pinned,
                    } as i32,
                    target: ri.target.clone(),
                    user: ri.user.clone().unwrap_or_default(),
                    declares_user: ri.user.is_some(),
                })
                .collect();
            instances.push(pb::InstanceStatus {
                instance: record.instance.clone(),
                generation: record.generation.0,
                images,
                written_at_ms: record.written_at_ms,
            });
        }
        let filter = (!want.is_empty()).then_some(want.as_str());
        let converges = store
            .converges(filter, 20)
            .await
            .map_err(store_status)?
            .into_iter()
            .map(|c| {
                let (outcome, reason) = match &c.state {
                    ConvergeState::Running => (pb::Outcome::Running, String::new()),
                    ConvergeState::Succeeded => (pb::Outcome::Succeeded, String::new()),
                    ConvergeState::Failed { reason } => (pb::Outcome::Failed, reason.clone()),
                };
                pb::ConvergeSummary {
                    id: c.id.to_string(),
                    instance: c.instance,
                    outcome: outcome as i32,
                    reason,
                    started_ms: c.started_ms,
                    finished_ms: c.finished_ms.unwrap_or(0),
                    requested_by: c.requested_by,
                }
            })
            .collect();
        Ok(Response::new(pb::StatusReply { instances, converges }))
    }

    type LogsStream = EventStream;

    async fn logs(&self, request: Request<pb::LogsRequest>) -> Result<Response<EventStream>, Status> {
        let req = request.into_inner();
        let id = crate::model::ConvergeId::from(req.converge_id.as_str());
        let store = self.engine.store.clone();
        if store.converge(&id).await.map_err(store_status)?.is_none() {
            return Err(Status::not_found(format!("no converge {id} — `kiln status` lists recent ones")));
        }
        let (tx, rx) = mpsc::channel(256);
        tokio::spawn(async move {
            let mut after = None;
            loop {
                let batch = match store.events(&id, after).await {
                    Ok(batch) => batch,
                    Err(err) => {
                        let _ = tx.send(Err(store_status(err))).await;
                        return;
                    }
                };
                for event in &batch {
                    after = Some(event.seq);
                    if tx.send(Ok(to_pb(&id, event))).await.is_err() {
                        return;
                    }
                }
                let running = matches!(store.converge(&id).await, Ok(Some(c)) if c.state == ConvergeState::Running);
                if !req.follow || (!running && batch.is_empty()) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn images(&self, _request: Request<pb::ImagesRequest>) -> Result<Response<pb::ImagesReply>, Status> {
        let mut stores = Vec::new();
        for agent in self.engine.hub.connected() {
            let outcome = agent.run("", pb::task::Kind::List(pb::ListTask {}), |_| {}).await;
            let store = agent.stores.first().map(|s| s.id.clone()).unwrap_or_else(|| agent.id.clone());
            let (images, error) = match outcome {
                Ok(pb::task_result::Outcome::Listing(l)) => (l.images, String::new()),
                Ok(_) => (Vec::new(), "the agent answered the listing with something else".to_string()),
                Err(err) => (Vec::new(), err.to_string()),
            };
            if error.is_empty() {
                let listed: Vec<_> = images.iter().cloned().map(crate::convert::listed_image).collect();
                let json = serde_json::to_string(&listed.iter().map(|i| (&i.id, &i.refs, i.bytes)).collect::<Vec<_>>())
                    .unwrap_or_default();
                let _ = self.engine.store.put_inventory(&store, json, now_ms()).await;
            }
            stores.push(pb::StoreImages { store, agent: agent.id.clone(), images, error });
        }
        Ok(Response::new(pb::ImagesReply { stores }))
    }

    async fn agents(&self, _request: Request<pb::AgentsRequest>) -> Result<Response<pb::AgentsReply>, Status> {
        let connected: Vec<String> = self.engine.hub.connected().iter().map(|a| a.id.clone()).collect();
        let rows = self.engine.store.agents().await.map_err(store_status)?;
        let agents = rows
            .into_iter()
            .map(|row| pb::AgentInfo {
                connected: connected.contains(&row.id.0),
                id: row.id.0,
                role: match row.role {
                    crate::model::AgentRole::Host => pb::Role::Host,
                    crate::model::AgentRole::Node => pb::Role::Node,
                    crate::model::AgentRole::Both => pb::Role::Both,
                } as i32,
                stores: row.stores,
                platforms: row.platforms,
                version: row.version,
                last_seen_ms: row.last_seen_ms,
            })
            .collect();
        Ok(Response::new(pb::AgentsReply { agents }))
    }
}
