//! Arbitrary `UpRequest` messages (prost-decoded from the input bytes, as tonic decodes them at the
//! edge) through the coordinator's conversion into an `UpPlan`: every refusal is `InvalidArgument`
//! and names the field it refuses, never a panic; every plan carries what the engine relies on.
#![no_main]

use kiln_coordinator::plan::{PlanKind, Target, UpPlan};
use kiln_proto::v1 as pb;
use libfuzzer_sys::fuzz_target;
use prost::Message as _;

/// The fields a refusal may name (each message names the one it refuses).
const FIELDS: &[&str] = &[
    "instance",
    "target",
    "registry",
    "platforms",
    "images[].name",
    "reference",
    "context_digest",
    "dockerfile",
    "kind",
    "from",
    "mirror_only",
];

fuzz_target!(|data: &[u8]| {
    let Ok(request) = pb::UpRequest::decode(data) else {
        return;
    };
    match UpPlan::try_from(request.clone()) {
        Ok(plan) => {
            assert!(!plan.instance.is_empty());
            assert_eq!(plan.instance, request.instance);
            assert!(!plan.platforms.is_empty());
            assert_eq!(plan.images.len(), request.images.len());
            if let Target::Registry { registry } = &plan.target {
                assert!(!registry.is_empty());
            }
            assert!(!plan.target.identity().is_empty());
            for (image, sent) in plan.images.iter().zip(&request.images) {
                assert!(!image.name.is_empty());
                let planned = kiln_core::refs::ImageRef::parse(&image.reference).expect("a planned reference parses");
                match &image.mirrored_from {
                    // A pin re-homed into the target's mirror: the upstream is kept, the digest
                    // never moves.
                    Some(upstream) => {
                        assert!(matches!(image.kind, PlanKind::Pinned));
                        assert_eq!(upstream, &sent.reference);
                        let upstream = kiln_core::refs::ImageRef::parse(upstream).expect("the upstream parses");
                        assert_eq!(planned.digest(), upstream.digest());
                    }
                    None => assert_eq!(image.reference, sent.reference),
                }
                if let PlanKind::Built(inputs) = &image.kind {
                    let sent_digest = sent.context_digest.strip_prefix("blake3:").unwrap_or(&sent.context_digest);
                    assert_eq!(inputs.context.to_string(), sent_digest.to_lowercase());
                    assert!(!inputs.dockerfile.is_empty() || !inputs.dockerfile_outside.is_empty());
                }
            }
        }
        Err(status) => {
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
            let message = status.message();
            assert!(FIELDS.iter().any(|field| message.contains(field)), "a refusal naming no field: {message}");
        }
    }
});
