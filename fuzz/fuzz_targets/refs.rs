//! Arbitrary strings into image reference parsing, the sweep planner's own normalization, and
//! platform parsing.
//!
//! Properties, on everything that parses:
//! - parse ∘ print is the identity: the familiar (`Display`) and the normalized spelling both parse
//!   back to the same ref;
//! - normalization is idempotent: printing what a printed ref parses to changes nothing, and the
//!   planner's normalization of its own output is that output;
//! - the planner's normalization agrees with `ImageRef` on every ref `ImageRef` accepts (the planner
//!   compares roots to listings with it; a disagreement would keep or sweep the wrong image);
//! - a platform's OCI spelling parses back to the same platform.
#![no_main]

use kiln_core::refs::{ImageRef, Platform};
use kiln_core::sweep::canonical_name;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(input) = std::str::from_utf8(data) else {
        return;
    };
    check_ref(input);
    check_planner_normalization(input);
    check_platform(input);
});

fn check_ref(input: &str) {
    let Ok(parsed) = ImageRef::parse(input) else {
        return;
    };
    let familiar = parsed.to_string();
    let normalized = parsed.normalized();
    for printed in [&familiar, &normalized] {
        let again = ImageRef::parse(printed).unwrap_or_else(|e| panic!("{input:?} printed as {printed:?}: {e}"));
        assert_eq!(again, parsed, "{input:?} printed as {printed:?}");
        assert_eq!(again.to_string(), familiar, "familiar form of {printed:?}");
        assert_eq!(again.normalized(), normalized, "normalized form of {printed:?}");
    }
    assert_eq!(parsed.repository(), format!("{}/{}", parsed.domain(), parsed.path()));
    assert!(parsed.tag().is_some() || parsed.digest().is_some(), "{input:?} has neither tag nor digest");
    if let Some(tag) = parsed.tag() {
        let retagged = parsed.with_tag(tag).unwrap_or_else(|e| panic!("{input:?}: its own tag refused: {e}"));
        assert_eq!(retagged.tag(), Some(tag));
        assert_eq!(retagged.digest(), None);
    }
}

fn check_planner_normalization(input: &str) {
    let Some(canonical) = canonical_name(input) else {
        return;
    };
    assert_eq!(canonical_name(&canonical).as_deref(), Some(canonical.as_str()), "planner's form of {input:?}");
    if let Ok(parsed) = ImageRef::parse(input) {
        assert_eq!(canonical, parsed.familiar(), "planner and ImageRef disagree on {input:?}");
    }
}

fn check_platform(input: &str) {
    let Ok(platform) = Platform::parse(input) else {
        return;
    };
    let oci = platform.oci();
    let again = Platform::parse(&oci).unwrap_or_else(|e| panic!("{input:?} printed as {oci:?}: {e}"));
    assert_eq!(again, platform, "{input:?} printed as {oci:?}");
    assert_eq!(again.token(), platform.token());
}
