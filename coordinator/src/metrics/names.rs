//! The label sets of the coordinator's metrics. Values come from closed vocabularies wherever
//! they can (a reason, a role, a method): a label naming something open-ended (a converge id, a
//! ref) would make a new series per converge and grow the scrape without bound.

use prometheus_client::encoding::EncodeLabelSet;

use crate::model;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ConvergeLabels {
    /// `up`, `down` or `gc`.
    pub kind: &'static str,
    /// `succeeded` or `failed`.
    pub outcome: &'static str,
    /// Who the queue is fair between: the instance's team (`team:NAME`), else the user who asked.
    pub owner: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct JobLabels {
    pub kind: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct Reason {
    pub reason: &'static str,
}

impl Reason {
    /// Why a build was skipped. A `nodes` or `kind` delivery that found a node lacking the image
    /// delivered it again from the host (`gone`): the build was still skipped.
    pub fn skip(reason: &model::Reason) -> Reason {
        let reason = match reason {
            model::Reason::Recorded => "recorded",
            model::Reason::Held { .. } => "held",
            model::Reason::HeldByFarm { .. } => "held_by_farm",
            model::Reason::Gone { .. } => "gone",
            model::Reason::FirstBuild | model::Reason::Forced | model::Reason::Changed { .. } => "other",
        };
        Reason { reason }
    }

    /// Why an image was built: as decided (first build, `--force`, inputs moved), or again because
    /// its ref was gone from a store — at the decision or at its use.
    pub fn build(reason: &model::Reason) -> Reason {
        let reason = match reason {
            model::Reason::Gone { .. } => "rebuilt_gone",
            _ => "built",
        };
        Reason { reason }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct Role {
    pub role: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct Store {
    pub store: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct TargetLabel {
    /// The target's identity: `registry:HOST`, `nodes:CLUSTER`, `kind:CLUSTER`, `local`.
    pub target: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct Method {
    /// The `StateStore` method called.
    pub method: &'static str,
}
