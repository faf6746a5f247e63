//! The one ref normalization the planner needs: turn whatever spelling a store, a record or a pod
//! used into one canonical string, so that `docker.io/library/x:latest` on a node and `x` in a
//! ConfigMap are recognized as the same name. Without it a root spelled one way would fail to keep
//! an image listed the other way, and the sweep would take an image a workload still needs.
//!
//! It also tells containerd's id-shaped refs (`sha256:<id>` and kind's `import-<date>@sha256:<m>`)
//! apart from names: those are aliases of an image, not names anyone chose, and the planner only
//! removes them together with the whole image.

use std::borrow::Cow;

/// A ref after normalization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum NormRef {
    /// A name someone chose: `repo:tag`, `repo@digest` or `repo:tag@digest`, with Docker Hub's
    /// implicit parts (`docker.io/`, `library/`, `:latest`) spelled the short way.
    Named {
        canonical: String,
        /// The `@sha256:…` part, when the ref pins content.
        digest: Option<String>,
    },
    /// A ref containerd keeps for an image rather than a name: `sha256:<id>`, or the
    /// `import-<date>@sha256:<manifest>` ref `kind load` leaves behind.
    Alias { digest: String },
}

const HUB_DOMAINS: [&str; 2] = ["docker.io", "index.docker.io"];
const OFFICIAL_NAMESPACE: &str = "library/";
const IMPORT_PREFIX: &str = "import-";
/// Official repositories whose short form would read as a digest (`sha256:<hex>`), shared with
/// [`crate::refs::ImageRef::familiar`].
const DIGEST_ALGORITHMS: [&str; 3] = crate::refs::DIGEST_ALGORITHMS;

// Not `crate::refs::ImageRef::parse`: a store lists refs no registry would accept (containerd keeps
// whatever it was handed), and the planner must still compare them instead of failing; it is also
// the hot loop of a 100k-image sweep. A test below holds the two to the same answer on valid refs.
pub(super) fn normalize(raw: &str) -> NormRef {
    if is_id_ref(raw) {
        return NormRef::Alias { digest: raw.to_owned() };
    }
    let (name_and_tag, digest) = match raw.split_once('@') {
        Some((name, digest)) => (name, Some(digest)),
        None => (raw, None),
    };
    let (name, tag) = split_tag(name_and_tag);
    let path = familiar_path(name);
    if let (Some(digest), None) = (digest, tag) {
        if is_import_name(&path) {
            return NormRef::Alias { digest: digest.to_owned() };
        }
    }
    let mut canonical = String::with_capacity(path.len() + 16 + digest.map_or(0, str::len));
    canonical.push_str(&path);
    match (tag, digest) {
        (Some(tag), _) => {
            canonical.push(':');
            canonical.push_str(tag);
        }
        // A digest ref names content, so it has no tag to default; `x` alone means `x:latest`.
        (None, None) => canonical.push_str(":latest"),
        (None, Some(_)) => {}
    }
    if let Some(digest) = digest {
        canonical.push('@');
        canonical.push_str(digest);
    }
    NormRef::Named { canonical, digest: digest.map(str::to_owned) }
}

/// `sha256:` followed by exactly 64 lowercase hex digits: how containerd spells an image id as a ref.
fn is_id_ref(raw: &str) -> bool {
    raw.strip_prefix("sha256:")
        .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
}

/// Splits `name[:tag]`: the tag follows the last `:`, unless a `/` does too, which makes that
/// colon a registry port (`localhost:5000/x`).
fn split_tag(name_and_tag: &str) -> (&str, Option<&str>) {
    match name_and_tag.rsplit_once(':') {
        Some((name, tag)) if !tag.contains('/') => (name, Some(tag)),
        _ => (name_and_tag, None),
    }
}

/// Drops Docker Hub's implicit domain and official namespace; any other registry keeps its name.
/// The Hub's domain stays (spelled `docker.io`) when what follows it would read as a domain of its
/// own: `my.org/x` names another registry than `docker.io/my.org/x` does. And the official
/// `library/sha256` keeps its namespace, since `sha256:<hex>` is how an image id is spelled.
fn familiar_path(name: &str) -> Cow<'_, str> {
    let path = match name.split_once('/') {
        Some((first, rest)) if HUB_DOMAINS.contains(&first) => match rest.split_once('/') {
            Some((next, _)) if is_domain(next) => return Cow::Owned(format!("{}/{rest}", HUB_DOMAINS[0])),
            _ => rest,
        },
        _ => name,
    };
    match path.strip_prefix(OFFICIAL_NAMESPACE) {
        Some(official) if DIGEST_ALGORITHMS.contains(&official) => Cow::Borrowed(path),
        // `library/x/y` is not an official image, so only a single component loses the namespace.
        Some(official) if !official.contains('/') => Cow::Borrowed(official),
        None if DIGEST_ALGORITHMS.contains(&path) => Cow::Owned(format!("{OFFICIAL_NAMESPACE}{path}")),
        _ => Cow::Borrowed(path),
    }
}

/// Docker's rule for the first path component: a domain has a dot, a port, is `localhost`, or
/// has an uppercase letter (which a repository path may not).
fn is_domain(first: &str) -> bool {
    first.contains(['.', ':']) || first == "localhost" || first.bytes().any(|b| b.is_ascii_uppercase())
}

/// `import-2026-11-29`: the name `ctr images import` gives an image it was handed without one.
fn is_import_name(path: &str) -> bool {
    path.strip_prefix(IMPORT_PREFIX)
        .is_some_and(|date| !date.is_empty() && date.bytes().all(|b| b.is_ascii_digit() || b == b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "4a77b1c2d3e4f5061728394a5b6c7d8e9f00112233445566778899aabbccddee";

    fn canonical(raw: &str) -> String {
        match normalize(raw) {
            NormRef::Named { canonical, .. } => canonical,
            NormRef::Alias { digest } => panic!("{raw} read as an alias of {digest}"),
        }
    }

    #[test]
    fn hub_spellings_meet_on_the_short_name() {
        for raw in
            ["x", "x:latest", "library/x", "docker.io/x", "docker.io/library/x:latest", "index.docker.io/library/x"]
        {
            assert_eq!(canonical(raw), "x:latest", "{raw}");
        }
        assert_eq!(canonical("docker.io/team/y:t"), "team/y:t");
        assert_eq!(canonical("index.docker.io/team/y:t"), "team/y:t");
        assert_eq!(canonical("library/x/y:t"), "library/x/y:t");
    }

    #[test]
    fn other_registries_keep_their_domain_and_port() {
        assert_eq!(canonical("localhost:5000/x"), "localhost:5000/x:latest");
        assert_eq!(canonical("reg.example.com/library/x:t"), "reg.example.com/library/x:t");
        assert_eq!(canonical("localhost/x:t"), "localhost/x:t");
    }

    #[test]
    fn a_digest_is_kept_and_suppresses_the_default_tag() {
        let pinned = format!("docker.io/library/envoy:v1.31@sha256:{HEX}");
        assert_eq!(
            normalize(&pinned),
            NormRef::Named { canonical: format!("envoy:v1.31@sha256:{HEX}"), digest: Some(format!("sha256:{HEX}")) }
        );
        assert_eq!(canonical(&format!("x@sha256:{HEX}")), format!("x@sha256:{HEX}"));
    }

    #[test]
    fn containerd_id_refs_are_aliases() {
        let id = format!("sha256:{HEX}");
        assert_eq!(normalize(&id), NormRef::Alias { digest: id.clone() });
        let import = format!("import-2026-11-29@sha256:{HEX}");
        assert_eq!(normalize(&import), NormRef::Alias { digest: id.clone() });
        let hub_import = format!("docker.io/library/import-2026-11-29@sha256:{HEX}");
        assert_eq!(normalize(&hub_import), NormRef::Alias { digest: id });
    }

    #[test]
    fn agrees_with_image_ref_on_valid_refs() {
        let pinned = format!("envoyproxy/envoy:v1@sha256:{HEX}");
        for raw in [
            "x",
            "x:1",
            "library/x",
            "docker.io/library/x:2",
            "index.docker.io/team/y",
            "team/y:t",
            "localhost:5000/a/b:c",
            "reg.example.com/library/x",
            "[::1]:5000/x:y",
            "Registry.Example/x",
            pinned.as_str(),
        ] {
            let parsed = crate::refs::ImageRef::parse(raw).unwrap();
            assert_eq!(canonical(raw), parsed.familiar(), "{raw}");
        }
    }

    #[test]
    fn names_that_only_resemble_aliases_stay_names() {
        assert_eq!(canonical("import-tool:1"), "import-tool:1");
        assert_eq!(canonical("import-2026-11-29:t"), "import-2026-11-29:t");
        // Not 64 lowercase hex digits: the official repository `sha256` with a tag.
        for raw in ["sha256:abc".to_owned(), format!("sha256:{}", &HEX[..63]), format!("sha256:{}", HEX.to_uppercase())]
        {
            assert_eq!(canonical(&raw), format!("library/{raw}"));
        }
    }

    #[test]
    fn a_tagless_repository_named_import_something_pinned_by_digest_is_a_name() {
        // A user's `import-tool`, pinned by digest, is no alias of kind's: it must be kept or
        // swept as the name it is, and only `import-<digits and dashes>` is kind's.
        for raw in [format!("import-tool@sha256:{HEX}"), format!("docker.io/library/import-tool@sha256:{HEX}")] {
            assert_eq!(canonical(&raw), format!("import-tool@sha256:{HEX}"), "{raw}");
        }
        assert_eq!(canonical(&format!("import-@sha256:{HEX}")), format!("import-@sha256:{HEX}"));
        assert_eq!(canonical(&format!("team/import-2026@sha256:{HEX}")), format!("team/import-2026@sha256:{HEX}"));
    }

    #[test]
    fn the_hub_domain_stays_where_the_rest_would_read_as_another_registry() {
        // Found by the `refs` fuzz target: `docker.io/ocker.io/x` printed as `ocker.io/x`.
        for (raw, want) in [
            ("docker.io/my.org/x", "docker.io/my.org/x:latest"),
            ("index.docker.io/my.org/x:t", "docker.io/my.org/x:t"),
            ("docker.io/localhost/x", "docker.io/localhost/x:latest"),
            ("docker.io/Team/x", "docker.io/Team/x:latest"),
            ("docker.io/a:5/x", "docker.io/a:5/x:latest"),
            ("docker.io/team/x", "team/x:latest"),
            ("docker.io/library/my.org/x", "library/my.org/x:latest"),
        ] {
            assert_eq!(canonical(raw), want, "{raw}");
        }
    }

    #[test]
    fn the_official_sha256_repository_keeps_its_namespace() {
        // Found by the `refs` fuzz target: `docker.io/sha256:<hex>` normalized to an id's spelling.
        for raw in [format!("docker.io/sha256:{HEX}"), format!("library/sha256:{HEX}"), "sha256:t".to_owned()] {
            assert!(canonical(&raw).starts_with("library/sha256:"), "{raw}");
        }
        assert_eq!(canonical("library/sha512"), "library/sha512:latest");
        assert_eq!(canonical("team/sha256:t"), "team/sha256:t");
    }

    #[test]
    fn a_colon_before_the_last_slash_is_a_port_not_a_tag() {
        assert_eq!(canonical("reg:5000/x"), "reg:5000/x:latest");
        assert_eq!(canonical("a:/b"), "a:/b:latest");
        assert_eq!(canonical("reg:5000/x:t"), "reg:5000/x:t");
        assert_eq!(canonical("x:"), "x:");
    }
}
