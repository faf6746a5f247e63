//! Holds: how one farm relies on an image another farm built, visibly on the daemon they share
//! (DESIGN.md "A Docker daemon shared by several farms").
//!
//! Content tags are global on a daemon, and a tag belongs to one image whose labels name one farm.
//! When farm B converges a context farm A already built, A's image is equivalent by address, so B
//! uses it instead of moving the tag to an image of its own (which would leave A's record naming a
//! tag A's sweep no longer sees as A's). B then tags the image once more, under a name in a
//! Kiln-owned namespace that says "farm B holds this": `kiln-hold/<farm key>/<path>:<tag>`. The
//! planner reads those tags both ways:
//! - an image wearing another farm's hold keeps every ref it has: its owner's sweep leaves it;
//! - a farm's own hold is removable by that farm's sweep alone, once none of its roots names any
//!   other ref of the image (the reliance ended), whoever's label the image carries.
//!
//! The hold names the farm by a short key, not by its id, because a farm id may hold characters a
//! repository path may not.

/// The repository namespace every hold tag lives under.
pub const HOLD_NAMESPACE: &str = "kiln-hold";

/// The 12-hex key naming `farm` in its hold tags.
pub fn farm_key(farm: &str) -> String {
    blake3::hash(farm.as_bytes()).to_hex()[..12].to_string()
}

/// The tag by which `farm` holds the image wearing `reference` (`repo:tag`). The registry part of
/// the ref is dropped (its port's colon cannot appear in a path); the farm key, path and tag keep
/// it readable and unique enough, and the planner never needs to read the held ref back.
pub fn hold_ref(farm: &str, reference: &str) -> Option<String> {
    let parsed = crate::refs::ImageRef::parse(reference).ok()?;
    let tag = parsed.tag()?;
    Some(format!("{HOLD_NAMESPACE}/{}/{}:{tag}", farm_key(farm), parsed.path()))
}

/// The farm key of a hold tag, in any spelling a store lists it (`docker.io/kiln-hold/…`), or
/// `None` when `raw` is not a hold.
pub fn hold_key(raw: &str) -> Option<&str> {
    let rest = raw.strip_prefix("docker.io/").or_else(|| raw.strip_prefix("index.docker.io/")).unwrap_or(raw);
    let rest = rest.strip_prefix(HOLD_NAMESPACE)?.strip_prefix('/')?;
    let (key, path) = rest.split_once('/')?;
    (key.len() == 12 && key.bytes().all(|b| b.is_ascii_hexdigit()) && !path.is_empty()).then_some(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hold_names_its_farm_by_key_and_keeps_path_and_tag() {
        let hold = hold_ref("embedded-ana-3f", "127.0.0.1:5000/team/app:4a77b1c2d3e4-amd64").unwrap();
        assert_eq!(hold, format!("kiln-hold/{}/team/app:4a77b1c2d3e4-amd64", farm_key("embedded-ana-3f")));
        assert!(crate::refs::ImageRef::parse(&hold).is_ok(), "a hold is a tag Docker accepts");
        assert_eq!(hold_key(&hold), Some(farm_key("embedded-ana-3f").as_str()));
        assert_eq!(hold_key(&format!("docker.io/{hold}")), Some(farm_key("embedded-ana-3f").as_str()));
        assert_ne!(farm_key("a"), farm_key("b"));
    }

    #[test]
    fn refs_that_only_resemble_holds_are_not_holds() {
        assert_eq!(hold_ref("f", "app@sha256:".to_string().as_str()), None);
        for raw in [
            "kiln-hold:1",
            "kiln-hold/abc/app:1",
            "kiln-holder/0123456789ab/app:1",
            "kiln-hold/0123456789ab",
            "x/kiln-hold/0123456789ab/a:1",
        ] {
            assert_eq!(hold_key(raw), None, "{raw}");
        }
        assert_eq!(hold_key("kiln-hold/0123456789ab/a:1"), Some("0123456789ab"));
    }
}
