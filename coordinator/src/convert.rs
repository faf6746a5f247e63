//! Conversions between the wire and the domain that more than one module needs.

use kiln_core::sweep::{Layer, ListedImage};
use kiln_proto::v1 as pb;

pub fn listed_image(img: pb::ListedImage) -> ListedImage {
    ListedImage {
        id: img.id,
        refs: img.refs,
        digests: img.digests,
        labels: img.labels.into_iter().collect(),
        bytes: img.bytes,
        layers: img.layers.into_iter().map(|l| Layer { chain: l.chain, bytes: l.bytes }).collect(),
    }
}

pub fn wire_image(img: ListedImage) -> pb::ListedImage {
    pb::ListedImage {
        id: img.id,
        refs: img.refs,
        digests: img.digests,
        labels: img.labels.into_iter().collect(),
        bytes: img.bytes,
        layers: img.layers.into_iter().map(|l| pb::Layer { chain: l.chain, bytes: l.bytes }).collect(),
    }
}
