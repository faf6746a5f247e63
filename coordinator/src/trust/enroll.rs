//! The `Enrollment` service: a join token and a certificate request in, a certificate signed by
//! the farm's CA out, naming the agent's id, role and cluster as the join token (made by an admin's
//! `kiln-coordinator enroll`) says. Join tokens are single use and short-lived; a renewal needs the
//! agent's current, unrevoked certificate and keeps the identity it names.

use std::sync::Arc;

use kiln_proto::v1 as pb;
use tonic::{Request, Response, Status};

use super::pki::{self, Authority};
use super::{tokens, Principal};
use crate::model::{AgentRole, AuditRow};
use crate::state::StateStore;

/// An agent id: what a host name may be, so it is safe in a URI and a log line.
fn valid_agent_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

#[derive(Clone)]
pub struct EnrollService {
    pub store: Arc<dyn StateStore>,
    /// `None` on a coordinator that does not verify callers (embedded, `--dev`): nothing to enroll in.
    pub authority: Option<Arc<Authority>>,
}

impl std::fmt::Debug for EnrollService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnrollService").finish_non_exhaustive()
    }
}

impl EnrollService {
    fn authority(&self) -> Result<&Authority, Status> {
        self.authority.as_deref().ok_or_else(|| {
            Status::failed_precondition(
                "this coordinator runs without TLS (embedded or --dev): agents connect without enrolling",
            )
        })
    }

    async fn audit(&self, actor: String, action: &str, target: &str, address: String, outcome: &str) {
        let entry = AuditRow {
            at_ms: pki::now_ms(),
            actor,
            action: action.to_string(),
            target: target.to_string(),
            address,
            outcome: outcome.to_string(),
        };
        if let Err(err) = self.store.append_audit(entry).await {
            tracing::warn!(error = %err, "audit entry not written");
        }
    }
}

fn reply(pem: String, ca_pem: &str, id: &str, role: AgentRole, cluster: &str, not_after_ms: u64) -> pb::EnrollReply {
    let role = match role {
        AgentRole::Node => pb::Role::Node,
        AgentRole::Host => pb::Role::Host,
        AgentRole::Both => pb::Role::Both,
    };
    pb::EnrollReply {
        certificate_pem: pem,
        ca_pem: ca_pem.to_string(),
        agent_id: id.to_string(),
        role: role as i32,
        cluster: cluster.to_string(),
        not_after_ms,
    }
}

#[tonic::async_trait]
impl pb::enrollment_server::Enrollment for EnrollService {
    async fn enroll(&self, request: Request<pb::EnrollRequest>) -> Result<Response<pb::EnrollReply>, Status> {
        let address = super::Peer::of(&request);
        let req = request.into_inner();
        let authority = self.authority()?;
        let refused = |why: &str| {
            Status::permission_denied(format!(
                "enrollment refused: {why} — ask an admin for a new one (`kiln-coordinator enroll`)"
            ))
        };
        let Some((id, secret, pin)) = tokens::parse_join(&req.join_token) else {
            self.audit("anonymous".into(), "enroll", &req.agent_id, address, "refused: not a join token").await;
            return Err(refused("that is not a join token"));
        };
        if pin != authority.fingerprint {
            self.audit("anonymous".into(), "enroll", &req.agent_id, address, "refused: another farm's join token")
                .await;
            return Err(refused("the join token was made for another farm's CA"));
        }
        if !valid_agent_id(&req.agent_id) {
            return Err(Status::invalid_argument(format!(
                "agent id {:?} is not usable — letters, digits, '-', '_' and '.', at most 128",
                req.agent_id
            )));
        }
        let now = pki::now_ms();
        let row = self.store.use_join(id, now).await.map_err(|e| Status::unavailable(kiln_core::error_chain(&e)))?;
        let verdict = match &row {
            None => Err("unknown join token"),
            Some(row) if !tokens::matches(secret, &row.hash) => Err("unknown join token"),
            Some(row) if row.used_ms.is_some() => Err("the join token was already used"),
            Some(row) if row.expires_ms <= now => Err("the join token expired"),
            Some(_) => Ok(()),
        };
        if let Err(why) = verdict {
            self.audit("anonymous".into(), "enroll", &req.agent_id, address, &format!("refused: {why}")).await;
            return Err(refused(why));
        }
        let row = row.expect("checked above");
        let (pem, not_after_ms) = authority
            .sign_agent(&req.csr_der, &req.agent_id, row.role, &row.cluster)
            .map_err(|e| Status::invalid_argument(kiln_core::error_chain(&e)))?;
        self.audit(format!("agent:{}", req.agent_id), "enroll", &req.agent_id, address, "ok").await;
        tracing::info!(agent = %req.agent_id, role = row.role.name(), cluster = %row.cluster, "agent enrolled");
        Ok(Response::new(reply(pem, &authority.ca_pem, &req.agent_id, row.role, &row.cluster, not_after_ms)))
    }

    async fn renew(&self, request: Request<pb::RenewRequest>) -> Result<Response<pb::EnrollReply>, Status> {
        let principal = Principal::of(&request);
        let address = super::Peer::of(&request);
        let authority = self.authority()?;
        let Principal::Agent { id, role, cluster, .. } = principal else {
            return Err(Status::permission_denied("only an enrolled agent renews its certificate"));
        };
        let req = request.into_inner();
        let (pem, not_after_ms) = authority
            .sign_agent(&req.csr_der, &id, role, &cluster)
            .map_err(|e| Status::invalid_argument(kiln_core::error_chain(&e)))?;
        self.audit(format!("agent:{id}"), "renew", &id, address, "ok").await;
        Ok(Response::new(reply(pem, &authority.ca_pem, &id, role, &cluster, not_after_ms)))
    }
}
