//! A manifest's platform set when it comes from the target's cluster (`platforms = "cluster"`, or
//! no `platforms` with a kind or nodes target): asked of the coordinator before anything is
//! addressed, by `kiln up` and `kiln refs` alike, so both name the same content tags.

use kiln_core::manifest::{Manifest, PlatformSource, Target};
use kiln_core::refs::PlatformSet;
use kiln_proto::v1 as pb;
use kiln_proto::v1::kiln_client::KilnClient;

use crate::connect::{self, Kind, Link};
use crate::error::CliError;

/// `manifest` with its cluster's platform set, when its set comes from there. With no node of
/// the cluster known (or a coordinator too old to say), a named `"cluster"` fails and an unnamed
/// one keeps this machine's platform, as before clusters were asked.
pub async fn from_cluster(link: &Link, manifest: Manifest) -> Result<Manifest, CliError> {
    let PlatformSource::Cluster { named } = manifest.platform_source else { return Ok(manifest) };
    let (kind, cluster) = match &manifest.target {
        Target::Kind { cluster } => ("kind", cluster.clone()),
        Target::Nodes { cluster } => ("nodes", cluster.clone()),
        _ => return Ok(manifest),
    };
    let kiln = KilnClient::new(link.channel.clone());
    let request = pb::ClusterPlatformsRequest { kind: kind.to_string(), cluster: cluster.clone() };
    let asked = connect::call(link, "ClusterPlatforms", Kind::Read, || {
        let (mut kiln, request) = (kiln.clone(), request.clone());
        async move { kiln.cluster_platforms(request).await }
    })
    .await;
    let reply = match asked {
        Ok(reply) => reply.into_inner(),
        Err(CliError::Refused { code: tonic::Code::Unimplemented, .. }) if !named => return Ok(manifest),
        Err(err) => return Err(err),
    };
    if reply.platforms.is_empty() {
        return match named {
            true => Err(CliError::NoClusterPlatforms { target: kind, cluster }),
            false => Ok(manifest),
        };
    }
    let set = PlatformSet::parse(reply.platforms.iter().map(String::as_str))
        .map_err(|err| CliError::BadClusterPlatforms { cluster: cluster.clone(), why: kiln_core::error_chain(&err) })?;
    Ok(manifest.with_cluster_platforms(set))
}
