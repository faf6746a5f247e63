//! The refs one platform's image of a multi-platform content ref wears on the build hosts and in a
//! registry: `<content ref>-<platform token>`, e.g. `shop-api:4a77b1c2d3e4-amd64.arm64-arm64`.
//!
//! A Docker daemon holds one platform's image per tag, so a multi-platform image exists on its
//! build hosts as one image per platform, each under its own tag; a registry holds those images
//! and the index that names them under the content tag. These tags are derived from the content
//! ref alone, so whatever keeps the content ref (a record, a claim) keeps its platforms' images
//! too, and no second list of names needs to be stored. A content tag has exactly one `-` after its
//! 12 hex digits, so a platform tag never reads as a content tag.

use super::{ImageRef, Platform};

/// The ref `platform`'s image of the multi-platform `content_ref` wears.
pub fn platform_ref(content_ref: &str, platform: &Platform) -> String {
    format!("{content_ref}-{}", platform.token())
}

/// Every platform ref a multi-platform content ref stands for, in its tag's order; none for a
/// one-platform content ref, a ref by digest, or a tag that is not a content tag.
pub fn platform_refs(content_ref: &str) -> Vec<String> {
    let Ok(parsed) = ImageRef::parse(content_ref) else { return Vec::new() };
    if parsed.digest().is_some() {
        return Vec::new();
    }
    let Some((address, set)) = parsed.tag().and_then(|tag| tag.split_once('-')) else { return Vec::new() };
    if address.len() != 12 || !address.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Vec::new();
    }
    let tokens: Vec<&str> = set.split('.').collect();
    if tokens.len() < 2 || tokens.iter().any(|t| t.is_empty()) {
        return Vec::new();
    }
    tokens.iter().map(|token| format!("{content_ref}-{token}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_multi_platform_ref_stands_for_one_ref_per_platform() {
        let content = "127.0.0.1:5000/shop-api:4a77b1c2d3e4-amd64.arm64";
        let arm = Platform::parse("linux/arm64").unwrap();
        assert_eq!(platform_ref(content, &arm), format!("{content}-arm64"));
        assert_eq!(platform_refs(content), vec![format!("{content}-amd64"), format!("{content}-arm64")]);
    }

    #[test]
    fn one_platform_digests_and_other_tags_stand_for_nothing_more() {
        assert!(platform_refs("shop-api:4a77b1c2d3e4-amd64").is_empty());
        assert!(platform_refs("shop-api:latest").is_empty());
        assert!(platform_refs("shop-api:release-amd64.arm64").is_empty());
        assert!(platform_refs(&format!("shop-api@sha256:{}", "a".repeat(64))).is_empty());
    }
}
