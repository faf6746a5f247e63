//! Image references, platform sets, the image address and the content tag.

use std::collections::{BTreeMap, HashSet};

use kiln_core::digest::TreeDigest;
use kiln_core::refs::{
    content_ref, image_address, AddressInputs, ContentTagError, ImageAddress, ImageRef, Platform, PlatformSet,
    RefProblem,
};

const D: &str = "sha256:7031c1b283388d2c2e09b57badb803c05ebed362dc88d84b480cc47f72a21097";

fn parse(s: &str) -> ImageRef {
    ImageRef::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn err(s: &str) -> String {
    match ImageRef::parse(s) {
        Ok(r) => panic!("{s} parsed as {r:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn normalizes_like_docker() {
    // input, normalized, familiar
    let cases = [
        ("x", "docker.io/library/x:latest", "x:latest"),
        ("x:1", "docker.io/library/x:1", "x:1"),
        ("docker.io/library/x", "docker.io/library/x:latest", "x:latest"),
        ("index.docker.io/x", "docker.io/library/x:latest", "x:latest"),
        ("index.docker.io/library/x:2", "docker.io/library/x:2", "x:2"),
        ("x/y", "docker.io/x/y:latest", "x/y:latest"),
        ("docker.io/x/y:t", "docker.io/x/y:t", "x/y:t"),
        ("library/a/b", "docker.io/library/a/b:latest", "library/a/b:latest"),
        ("localhost/x", "localhost/x:latest", "localhost/x:latest"),
        ("localhost:5000/a/b:t", "localhost:5000/a/b:t", "localhost:5000/a/b:t"),
        ("127.0.0.1:5000/a/b:t", "127.0.0.1:5000/a/b:t", "127.0.0.1:5000/a/b:t"),
        (&format!("reg:5000/a/b:t@{D}"), &format!("reg:5000/a/b:t@{D}"), &format!("reg:5000/a/b:t@{D}")),
        (&format!("x@{D}"), &format!("docker.io/library/x@{D}"), &format!("x@{D}")),
        ("[::1]:5000/foo:1", "[::1]:5000/foo:1", "[::1]:5000/foo:1"),
        ("Registry.Example.com/a", "Registry.Example.com/a:latest", "Registry.Example.com/a:latest"),
        ("a_b/c__d/e-f.g:V1.0_rc-2", "docker.io/a_b/c__d/e-f.g:V1.0_rc-2", "a_b/c__d/e-f.g:V1.0_rc-2"),
        // A ':' with no '/' after it starts a tag, as in Docker: this is Hub's `127.0.0.1` at tag 5000.
        ("127.0.0.1:5000", "docker.io/library/127.0.0.1:5000", "127.0.0.1:5000"),
        // Found by the `refs` fuzz target: a Hub path whose first component reads as a domain
        // keeps `docker.io/`, or its short form would name another registry.
        ("docker.io/my.org/x", "docker.io/my.org/x:latest", "docker.io/my.org/x:latest"),
        ("index.docker.io/localhost/x:1", "docker.io/localhost/x:1", "docker.io/localhost/x:1"),
        // ... and the official `sha256` keeps `library/`: `sha256:<hex>` is an image id to Docker.
        ("docker.io/sha256:beef", "docker.io/library/sha256:beef", "library/sha256:beef"),
    ];
    for (input, normalized, familiar) in cases {
        let r = parse(input);
        assert_eq!(r.normalized(), normalized, "normalized({input})");
        assert_eq!(r.familiar(), familiar, "familiar({input})");
        assert_eq!(r.to_string(), familiar, "Display({input})");
        assert_eq!(parse(familiar), r, "the short form of {input} parses back to it");
    }
}

#[test]
fn accessors_split_the_parts() {
    let r = parse(&format!("127.0.0.1:5000/team/api:v1@{D}"));
    assert_eq!(r.domain(), "127.0.0.1:5000");
    assert_eq!(r.path(), "team/api");
    assert_eq!(r.tag(), Some("v1"));
    assert_eq!(r.digest(), Some(D));
    assert_eq!(r.repository(), "127.0.0.1:5000/team/api");

    let bare = parse("postgres");
    assert_eq!(
        (bare.domain(), bare.path(), bare.tag(), bare.digest()),
        ("docker.io", "library/postgres", Some("latest"), None)
    );
    assert_eq!(bare.repository(), "docker.io/library/postgres");

    // A digest alone does not imply :latest.
    assert_eq!(parse(&format!("x@{D}")).tag(), None);
}

#[test]
fn equality_and_hash_follow_the_normalized_form() {
    let same = ["x", "x:latest", "docker.io/library/x", "index.docker.io/library/x:latest", "library/x"];
    let set: HashSet<ImageRef> = same.iter().map(|s| parse(s)).collect();
    assert_eq!(set.len(), 1, "{set:?}");
    assert_eq!(parse("docker.io/x/y"), parse("x/y"));
    assert_eq!(parse("x/y:latest"), parse("index.docker.io/x/y"));

    assert_ne!(parse("x:1"), parse("x:2"));
    assert_ne!(parse("x"), parse("y"));
    assert_ne!(parse("x/y"), parse("library/y"));
    assert_ne!(parse("localhost/x"), parse("x"));
    assert_ne!(parse(&format!("x@{D}")), parse("x"));
    assert_eq!("x".parse::<ImageRef>().unwrap(), parse("docker.io/library/x:latest"));
}

#[test]
fn errors_name_the_input_and_the_part() {
    assert_eq!(err(""), r#"image ref "": empty"#);
    assert_eq!(err("Foo:1"), r#"image ref "Foo:1": repository name must be lowercase"#);
    assert_eq!(err("docker.io/Foo"), r#"image ref "docker.io/Foo": repository name must be lowercase"#);
    assert!(err("a..b").starts_with(r#"image ref "a..b": name component "a..b" is invalid"#));
    assert!(err("x/a___b:1").contains(r#"name component "a___b" is invalid"#));
    assert!(err("x/-a").contains(r#"name component "-a""#));
    assert!(err("a//b").contains(r#"repository name "a//b" has an empty path component"#));
    assert!(err("x/").contains("has an empty path component"));
    assert!(err("x:").contains(r#"tag "" is invalid"#));
    assert!(err("x:-a").contains(r#"tag "-a" is invalid: it must start with"#));
    assert!(err("x:a+b").contains(r#"tag "a+b" is invalid"#));
    assert!(err(&format!("x:{}", "a".repeat(129))).contains("longer than 128"));
    assert!(ImageRef::parse(&format!("x:{}", "a".repeat(128))).is_ok());
    assert!(err("x@sha256:abc").contains(r#"digest "sha256:abc" is invalid: digest must be sha256:<64 lowercase hex>"#));
    assert!(err(&format!("x@{}", D.to_uppercase().replace("SHA256", "sha256"))).contains("digest must be sha256"));
    assert!(err("x@abc").contains("digest must be sha256"));
    assert!(err(&format!("x@sha512:{}", "a".repeat(128))).contains(r#"digest algorithm "sha512" is not supported"#));
    assert!(err(":1").contains("repository name is empty"));
    assert!(err(&format!("@{D}")).contains("repository name is empty"));
    assert!(err("reg.io:50a/x").contains(r#"domain "reg.io:50a" is invalid: the port must be digits"#));
    assert!(err("-reg.io/x").contains(r#"domain "-reg.io" is invalid"#));
    assert!(err(&"a".repeat(64)).contains("image id"));
    assert!(err("x y").contains(r#"name component "x y""#));
}

#[test]
fn a_64_character_name_reads_as_an_image_id_only_when_it_is_lowercase_hex() {
    let not_hex = "g".repeat(64);
    assert_eq!(parse(&not_hex).path(), format!("library/{not_hex}"));
    assert_eq!(ImageRef::parse(&"A".repeat(64)).unwrap_err().problem(), &RefProblem::Uppercase);
    assert_eq!(ImageRef::parse(&"a".repeat(64)).unwrap_err().problem(), &RefProblem::LooksLikeImageId);
    // One character short of an id is a name.
    assert_eq!(parse(&"a".repeat(63)).path(), format!("library/{}", "a".repeat(63)));
}

#[test]
fn a_digest_algorithm_docker_could_not_name_is_a_bad_digest_and_a_well_formed_one_is_unsupported() {
    let hex = &D["sha256:".len()..];
    for bad in [format!("SHA256:{hex}"), format!(":{hex}"), format!("sha 256:{hex}")] {
        let e = ImageRef::parse(&format!("x@{bad}")).unwrap_err();
        assert_eq!(e.problem(), &RefProblem::BadDigest { digest: bad.clone() }, "{bad}");
    }
    let e = ImageRef::parse(&format!("x@sha3-256+b.x_y:{hex}")).unwrap_err();
    assert_eq!(e.problem(), &RefProblem::UnsupportedDigest { algorithm: "sha3-256+b.x_y".to_string() });
}

#[test]
fn a_colon_before_the_last_slash_is_a_port_and_after_it_a_tag() {
    let r = parse("reg:5000/a:1");
    assert_eq!((r.domain(), r.path(), r.tag()), ("reg:5000", "a", Some("1")));
    let r = parse("reg:5000/a");
    assert_eq!((r.domain(), r.path(), r.tag()), ("reg:5000", "a", Some("latest")));
    assert_eq!(parse("reg:5000/a:latest"), r);
}

#[test]
fn debug_forms_name_the_type_and_its_full_form() {
    assert_eq!(format!("{:?}", parse("x")), "ImageRef(docker.io/library/x:latest)");
    assert_eq!(format!("{:?}", Platform::parse("arm").unwrap()), "Platform(linux/arm/v7)");
    assert_eq!(format!("{:?}", PlatformSet::parse(["arm", "amd64"]).unwrap()), "PlatformSet(amd64.armv7)");
    let address = Owned::base().address();
    assert_eq!(format!("{address:?}"), format!("ImageAddress({address})"));
}

#[test]
fn a_platform_displays_as_its_token_and_exposes_its_canonical_parts() {
    let windows = Platform::parse("windows/x86_64").unwrap();
    assert_eq!(windows.to_string(), "windows-amd64");
    assert_eq!((windows.os(), windows.arch(), windows.variant()), ("windows", "amd64", None));
    let arm = Platform::parse("arm/6").unwrap();
    assert_eq!(arm.to_string(), "armv6");
    assert_eq!((arm.os(), arm.arch(), arm.variant()), ("linux", "arm", Some("v6")));
}

#[test]
fn platforms_compare_by_their_token() {
    let amd64 = Platform::parse("amd64").unwrap();
    let arm64 = Platform::parse("linux/arm64").unwrap();
    let windows = Platform::parse("windows/amd64").unwrap();
    assert_eq!(amd64.partial_cmp(&arm64), Some(std::cmp::Ordering::Less));
    assert_eq!(windows.partial_cmp(&arm64), Some(std::cmp::Ordering::Greater));
    assert_eq!(amd64.partial_cmp(&Platform::parse("x86_64").unwrap()), Some(std::cmp::Ordering::Equal));
    assert!(amd64 < arm64 && arm64 < windows);
}

#[test]
fn a_platform_set_is_never_empty_and_the_host_set_holds_the_host() {
    let set = PlatformSet::parse(["amd64"]).unwrap();
    assert!(!set.is_empty());
    let host = PlatformSet::host();
    assert!(!host.is_empty());
    assert_eq!(host.len(), 1);
    assert_eq!(host.iter().collect::<Vec<_>>(), [&Platform::host()]);
}

#[test]
fn name_length_counts_the_normalized_name() {
    // docker.io/library/ is 18 characters: 237 fits in 255, 238 does not.
    assert!(ImageRef::parse(&"a".repeat(237)).is_ok());
    assert!(err(&"a".repeat(238)).contains("repository name is 256 characters"));
}

#[test]
fn problem_is_matchable() {
    let e = ImageRef::parse("Foo").unwrap_err();
    assert_eq!(e.input(), "Foo");
    assert_eq!(e.problem(), &RefProblem::Uppercase);
}

#[test]
fn with_tag_replaces_tag_and_digest() {
    let r = parse(&format!("reg.io/a:1@{D}")).with_tag("2").unwrap();
    assert_eq!(r.normalized(), "reg.io/a:2");
    assert!(parse("a").with_tag("-x").unwrap_err().to_string().contains(r#"tag "-x" is invalid"#));
}

fn tree() -> TreeDigest {
    let mut bytes = [0u8; 32];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = i as u8;
    }
    TreeDigest(bytes)
}

struct Owned {
    tree: TreeDigest,
    outside: Option<Vec<u8>>,
    path: String,
    args: BTreeMap<String, String>,
    target: Option<String>,
    platforms: PlatformSet,
}

impl Owned {
    fn base() -> Owned {
        Owned {
            tree: tree(),
            outside: Some(b"FROM scratch\n".to_vec()),
            path: "Dockerfile".to_string(),
            args: [("A", "1"), ("B", "two")].into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            target: Some("runtime".to_string()),
            platforms: PlatformSet::parse(["linux/arm64", "linux/amd64"]).unwrap(),
        }
    }

    fn address(&self) -> ImageAddress {
        image_address(&AddressInputs {
            tree: self.tree,
            dockerfile_outside: self.outside.as_deref(),
            dockerfile_path: &self.path,
            build_args: &self.args,
            target: self.target.as_deref(),
            platforms: &self.platforms,
        })
    }
}

/// Pinned from an encoding built outside Rust (the documented byte layout piped through `b3sum`),
/// so a change to the encoding cannot pass unnoticed: it must bump the version and this value.
#[test]
fn address_encoding_is_pinned() {
    assert_eq!(Owned::base().address().to_string(), "4d62984aa8ac23028354d68a5053d9c70a6bec917f0cd11435e10d288432017a");
    assert_eq!(Owned::base().address().short12(), "4d62984aa8ac");
}

#[test]
fn every_input_changes_the_address() {
    let base = Owned::base().address();
    type Change = fn(&mut Owned);
    let changes: &[(&str, Change)] = &[
        ("tree", |o| o.tree.0[31] ^= 1),
        ("outside contents", |o| o.outside = Some(b"FROM scratch \n".to_vec())),
        ("outside vs inside", |o| o.outside = None),
        ("empty outside vs inside", |o| o.outside = Some(Vec::new())),
        ("dockerfile path", |o| o.path = "docker/api.Dockerfile".to_string()),
        ("arg value", |o| {
            o.args.insert("A".to_string(), "2".to_string());
        }),
        ("arg added", |o| {
            o.args.insert("C".to_string(), String::new());
        }),
        ("arg removed", |o| {
            o.args.remove("B");
        }),
        ("arg boundary", |o| {
            o.args.clear();
            o.args.insert("A1".to_string(), "".to_string());
            o.args.insert("B".to_string(), "two".to_string());
        }),
        ("target stage", |o| o.target = Some("build".to_string())),
        ("no target", |o| o.target = None),
        ("empty target vs none", |o| o.target = Some(String::new())),
        ("platforms", |o| o.platforms = PlatformSet::parse(["linux/amd64"]).unwrap()),
        ("platform variant", |o| o.platforms = PlatformSet::parse(["linux/amd64", "linux/arm64/v9"]).unwrap()),
    ];
    let mut seen = HashSet::from([base]);
    for (what, change) in changes {
        let mut o = Owned::base();
        change(&mut o);
        let address = o.address();
        assert_ne!(address, base, "{what} did not change the address");
        assert!(seen.insert(address), "{what} collided with another change");
    }
}

#[test]
fn same_inputs_same_address_whatever_the_arg_insertion_order() {
    let mut reversed = Owned::base();
    reversed.args = [("B", "two"), ("A", "1")].into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    reversed.platforms = PlatformSet::parse(["amd64", "aarch64"]).unwrap();
    assert_eq!(reversed.address(), Owned::base().address());
}

#[test]
fn content_ref_is_repo_address12_platforms() {
    let o = Owned::base();
    let address = o.address();
    let r = content_ref("shop-api", &address, &o.platforms).unwrap();
    assert_eq!(r.familiar(), "shop-api:4d62984aa8ac-amd64.arm64");
    assert_eq!(r.normalized(), "docker.io/library/shop-api:4d62984aa8ac-amd64.arm64");
    assert_eq!(r.digest(), None);

    let r = content_ref("127.0.0.1:5000/team/shop-api", &address, &PlatformSet::parse(["arm"]).unwrap()).unwrap();
    assert_eq!(r.normalized(), "127.0.0.1:5000/team/shop-api:4d62984aa8ac-armv7");
}

#[test]
fn content_ref_refuses_tagged_or_invalid_repos() {
    let o = Owned::base();
    let address = o.address();
    assert_eq!(
        content_ref("shop-api:1", &address, &o.platforms),
        Err(ContentTagError::RepositoryHasTag { repo: "shop-api:1".to_string() })
    );
    assert!(matches!(
        content_ref(&format!("a@{D}"), &address, &o.platforms),
        Err(ContentTagError::RepositoryHasTag { .. })
    ));
    let e = content_ref("Shop", &address, &o.platforms).unwrap_err();
    assert_eq!(e.to_string(), r#"repository "Shop" cannot carry a content tag"#);
    let source = std::error::Error::source(&e).unwrap().to_string();
    assert_eq!(source, r#"image ref "Shop": repository name must be lowercase"#);
}

#[test]
fn content_tag_longer_than_128_names_the_platforms() {
    let many = [
        "386",
        "amd64",
        "arm/v5",
        "arm/v6",
        "arm/v7",
        "arm64",
        "arm64/v9",
        "ppc64le",
        "s390x",
        "riscv64",
        "mips64le",
        "loong64",
        "windows/amd64",
        "windows/arm64",
        "freebsd/amd64",
    ];
    let platforms = PlatformSet::parse(many).unwrap();
    let e = content_ref("x", &Owned::base().address(), &platforms).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ContentTagError::TooLong { len: 135, .. }), "{msg}");
    assert!(msg.contains(&platforms.to_string()), "{msg}");
    assert!(msg.contains("over Docker's 128"), "{msg}");
}

#[test]
fn a_content_tag_of_exactly_128_characters_is_accepted_and_one_of_129_is_not() {
    let fits = [
        "mips",
        "amd64",
        "arm/v5",
        "arm/v6",
        "arm/v7",
        "arm64",
        "ppc64le",
        "s390x",
        "riscv64",
        "mips64le",
        "loong64",
        "windows/amd64",
        "windows/arm64",
        "freebsd/amd64",
    ];
    let address = Owned::base().address();
    let platforms = PlatformSet::parse(fits).unwrap();
    let r = content_ref("x", &address, &platforms).unwrap();
    assert_eq!(r.tag().map(str::len), Some(128), "{r}");
    assert_eq!(r.tag(), Some(format!("{}-{platforms}", address.short12()).as_str()));

    // `mips` → `ppc64`: one character more.
    let over = PlatformSet::parse(fits.map(|p| if p == "mips" { "ppc64" } else { p })).unwrap();
    assert!(matches!(content_ref("x", &address, &over), Err(ContentTagError::TooLong { len: 129, .. })));
}
