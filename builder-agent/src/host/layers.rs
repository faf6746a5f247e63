//! Each image's layers, for a sweep that reports real bytes: which layers two images share (by
//! chain: a layer and everything beneath it), and each layer's own size.
//!
//! Docker's API has no per-layer size. It has the image's layer diff ids (`RootFS.Layers`, bottom
//! first) and its history, whose entries carry the size of the layer each step made (0 for steps
//! that made none). The steps that made a non-empty layer line up with the diff ids that are not
//! the empty layer, in order; a step of size 0 facing a non-empty diff (a layer that only deletes)
//! is taken as a layer only when the remaining sized steps could not cover the remaining diffs.
//! Images never change, so what was read for an id is kept.

use std::collections::HashMap;
use std::sync::Mutex;

use kiln_core::sweep::Layer;

/// The diff id of an empty tar: a step that changed no file.
const EMPTY_LAYER: &str = "sha256:5f70bf18a086007016e948b04aed3b82103a36bea41755b6cddfaf10ace3c6ef";

/// Layers already read, by image id.
#[derive(Debug, Default)]
pub(super) struct LayerCache {
    by_id: Mutex<HashMap<String, Vec<Layer>>>,
}

impl LayerCache {
    pub(super) fn get(&self, id: &str) -> Option<Vec<Layer>> {
        self.by_id.lock().unwrap().get(id).cloned()
    }

    pub(super) fn put(&self, id: &str, layers: Vec<Layer>) {
        let mut by_id = self.by_id.lock().unwrap();
        // Bounded: a build host's images come and go; forgetting only costs a re-read.
        if by_id.len() > 50_000 {
            by_id.clear();
        }
        by_id.insert(id.to_string(), layers);
    }
}

/// The layers of an image from its diff ids (bottom first) and its history's sizes (oldest first).
pub(super) fn layers(diff_ids: &[String], history_sizes: &[u64]) -> Vec<Layer> {
    let mut sizes = vec![0u64; diff_ids.len()];
    let mut steps = history_sizes.iter().copied().peekable();
    let nonempty_after = |k: usize| diff_ids[k..].iter().filter(|d| d.as_str() != EMPTY_LAYER).count();
    for (k, diff) in diff_ids.iter().enumerate() {
        if diff == EMPTY_LAYER {
            continue;
        }
        // Skip steps that made no layer, unless the sized steps left could not cover the diffs left.
        while let Some(&size) = steps.peek() {
            let sized_left = steps.clone().filter(|s| *s > 0).count();
            if size > 0 || sized_left < nonempty_after(k) {
                break;
            }
            steps.next();
        }
        sizes[k] = steps.next().unwrap_or(0);
    }
    let mut chain = String::new();
    diff_ids
        .iter()
        .zip(sizes)
        .map(|(diff, bytes)| {
            chain = if chain.is_empty() {
                diff.clone()
            } else {
                blake3::hash(format!("{chain} {diff}").as_bytes()).to_hex().to_string()
            };
            Layer { chain: chain.clone(), bytes }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(n: u8) -> String {
        format!("sha256:{:064x}", n)
    }

    #[test]
    fn sized_steps_line_up_with_non_empty_diffs() {
        // FROM base (10) ; ENV (no layer) ; COPY (5) ; RUN true (empty layer) ; COPY (7)
        let diffs = [d(1), d(2), EMPTY_LAYER.to_string(), d(3)];
        let got = layers(&diffs, &[10, 0, 5, 0, 7]);
        assert_eq!(got.iter().map(|l| l.bytes).collect::<Vec<_>>(), vec![10, 5, 0, 7]);
        assert_eq!(got[0].chain, d(1), "the bottom layer's chain is its diff id");
    }

    #[test]
    fn two_images_on_one_base_share_its_chain_and_nothing_above() {
        let a = layers(&[d(1), d(2)], &[10, 5]);
        let b = layers(&[d(1), d(3)], &[10, 6]);
        let c = layers(&[d(9), d(2)], &[4, 5]);
        assert_eq!(a[0].chain, b[0].chain);
        assert_ne!(a[1].chain, b[1].chain);
        assert_ne!(a[1].chain, c[1].chain, "the same diff on another base is another layer");
    }

    #[test]
    fn a_zero_sized_layer_that_only_deletes_is_counted_when_it_must_be() {
        // COPY (10) ; RUN rm (a whiteout: non-empty diff, size 0) ; COPY (3)
        let got = layers(&[d(1), d(2), d(3)], &[10, 0, 3]);
        assert_eq!(got.iter().map(|l| l.bytes).collect::<Vec<_>>(), vec![10, 0, 3]);
    }
}
