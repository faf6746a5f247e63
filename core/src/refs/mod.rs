//! Image references, platforms and the content tag.
//!
//! [`ImageRef::parse`] follows the grammar of Docker's distribution reference
//! (`[domain/]path[:tag][@sha256:hex]`) and normalizes as Docker does, so that two spellings of one
//! image compare equal: a missing domain is `docker.io`, `index.docker.io` is `docker.io`, a
//! single-component path on `docker.io` gets `library/`, and a ref with neither tag nor digest is
//! `:latest`. The sweep compares roots to store listings after this normalization (DESIGN.md
//! "Reachability"); without it `postgres` in a pod spec would not keep `docker.io/library/postgres:latest`.
//!
//! [`platform`] canonicalizes `os/arch[/variant]` into the short tokens a content tag carries, and
//! [`address`] defines the image address — the tree digest plus every other build input — and the
//! content tag `<repo>:<address12>-<platforms>` built from it.

pub mod address;
pub mod mirror;
pub mod per_platform;
pub mod platform;

use std::fmt;
use std::str::FromStr;

pub use address::{content_ref, content_tag, image_address, AddressInputs, ContentTagError, ImageAddress};
pub use mirror::mirrored;
pub use per_platform::{platform_ref, platform_refs};
pub use platform::{Platform, PlatformError, PlatformSet};

/// The registry a ref without a domain names.
pub const DEFAULT_DOMAIN: &str = "docker.io";
/// An older spelling of [`DEFAULT_DOMAIN`] that must compare equal to it.
const LEGACY_DEFAULT_DOMAIN: &str = "index.docker.io";
/// Docker Hub's namespace for official images: `postgres` is `library/postgres`.
const OFFICIAL_PREFIX: &str = "library/";
/// Digest algorithms Docker knows: an official repository of one of these names keeps its
/// `library/` in the short form, which would otherwise read as a digest (`sha256:<hex>`).
pub(crate) const DIGEST_ALGORITHMS: [&str; 3] = ["sha256", "sha384", "sha512"];
/// Docker's limit on `domain/path`; registries refuse longer names.
pub const NAME_TOTAL_LENGTH_MAX: usize = 255;
/// Docker's limit on a tag (the grammar's `{0,127}` after the first character).
pub const TAG_LENGTH_MAX: usize = 128;

/// A parsed, normalized image reference.
///
/// Fields are stored normalized, so the derived `PartialEq`/`Hash` compare the normalized form:
/// `x`, `x:latest` and `docker.io/library/x:latest` are one ref.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageRef {
    domain: String,
    path: String,
    tag: Option<String>,
    digest: Option<String>,
}

impl ImageRef {
    /// Parses and normalizes `input`; the error names the part that is wrong.
    pub fn parse(input: &str) -> Result<ImageRef, RefError> {
        let mut image = parse_parts(input)?;
        if image.tag.is_none() && image.digest.is_none() {
            image.tag = Some("latest".to_string());
        }
        Ok(image)
    }

    /// The registry host, with its port if any (`docker.io`, `127.0.0.1:5000`).
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// The repository path within the registry (`library/postgres`, `team/api`).
    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn tag(&self) -> Option<&str> {
        self.tag.as_deref()
    }

    /// The digest as written, `sha256:<64 hex>`.
    pub fn digest(&self) -> Option<&str> {
        self.digest.as_deref()
    }

    /// The normalized name without tag or digest: `docker.io/library/postgres`.
    pub fn repository(&self) -> String {
        format!("{}/{}", self.domain, self.path)
    }

    /// The full form: `docker.io/library/x:latest`, `reg:5000/a/b:t@sha256:…`.
    pub fn normalized(&self) -> String {
        with_suffixes(self.repository(), self)
    }

    /// Docker's short form: `docker.io/` and a lone `library/` dropped (`x:latest`, `x/y:t`).
    /// `docker.io/` stays when the path would then read as another registry's name
    /// (`docker.io/my.org/x`), and `library/` when the name would read as a digest
    /// (`library/sha256:<hex>`), so the short form always parses back to this ref, in Kiln and
    /// in Docker.
    pub fn familiar(&self) -> String {
        let name = if self.domain == DEFAULT_DOMAIN {
            match self.path.strip_prefix(OFFICIAL_PREFIX) {
                Some(rest) if !rest.contains('/') && !DIGEST_ALGORITHMS.contains(&rest) => rest.to_string(),
                _ if split_domain(&self.path).0.is_some() => self.repository(),
                _ => self.path.clone(),
            }
        } else {
            self.repository()
        };
        with_suffixes(name, self)
    }

    /// This repository with `tag` and no digest: the ref a build writes.
    pub fn with_tag(&self, tag: &str) -> Result<ImageRef, RefError> {
        let input = format!("{}:{tag}", self.repository());
        check_tag(tag).map_err(|problem| RefError { input, problem })?;
        Ok(ImageRef { domain: self.domain.clone(), path: self.path.clone(), tag: Some(tag.to_string()), digest: None })
    }
}

fn with_suffixes(mut name: String, image: &ImageRef) -> String {
    if let Some(tag) = &image.tag {
        name.push(':');
        name.push_str(tag);
    }
    if let Some(digest) = &image.digest {
        name.push('@');
        name.push_str(digest);
    }
    name
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.familiar())
    }
}

impl fmt::Debug for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ImageRef({})", self.normalized())
    }
}

impl FromStr for ImageRef {
    type Err = RefError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ImageRef::parse(s)
    }
}

/// Why a string is not an image reference. Displays as `image ref "<input>": <problem>`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("image ref {input:?}: {problem}")]
pub struct RefError {
    input: String,
    problem: RefProblem,
}

impl RefError {
    pub(crate) fn new(input: &str, problem: RefProblem) -> RefError {
        RefError { input: input.to_string(), problem }
    }

    /// The string that failed to parse.
    pub fn input(&self) -> &str {
        &self.input
    }

    pub fn problem(&self) -> &RefProblem {
        &self.problem
    }
}

/// The part of a reference that is wrong, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RefProblem {
    #[error("empty")]
    Empty,
    #[error("repository name is empty")]
    EmptyName,
    #[error("is 64 hex characters, which Docker reads as an image id — write a repository name")]
    LooksLikeImageId,
    #[error("repository name must be lowercase")]
    Uppercase,
    #[error("repository name {name:?} has an empty path component")]
    EmptyComponent { name: String },
    #[error(
        "name component {component:?} is invalid: use lowercase letters and digits, separated by one '.', \
         one or two '_', or dashes"
    )]
    BadComponent { component: String },
    #[error("domain {domain:?} is invalid: {why}")]
    BadDomain { domain: String, why: &'static str },
    #[error("repository name is {len} characters; Docker allows at most {NAME_TOTAL_LENGTH_MAX}")]
    NameTooLong { len: usize },
    #[error("tag {tag:?} is invalid: {why}")]
    BadTag { tag: String, why: &'static str },
    #[error("digest {digest:?} is invalid: digest must be sha256:<64 lowercase hex>")]
    BadDigest { digest: String },
    #[error("digest algorithm {algorithm:?} is not supported: digest must be sha256:<64 lowercase hex>")]
    UnsupportedDigest { algorithm: String },
}

/// Parses without defaulting the tag, so callers can tell a written `:latest` from none.
pub(crate) fn parse_parts(input: &str) -> Result<ImageRef, RefError> {
    let fail = |problem| RefError { input: input.to_string(), problem };
    if input.is_empty() {
        return Err(fail(RefProblem::Empty));
    }
    // Docker refuses a bare 64-hex string: it would be ambiguous with an image id.
    if input.len() == 64 && input.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()) {
        return Err(fail(RefProblem::LooksLikeImageId));
    }
    let (name_tag, digest) = match input.split_once('@') {
        Some((n, d)) => (n, Some(d)),
        None => (input, None),
    };
    if let Some(digest) = digest {
        check_digest(digest).map_err(fail)?;
    }
    // A ':' after the last '/' starts the tag; one before it belongs to a domain's port.
    let (name, tag) = match name_tag.rsplit_once(':') {
        Some((name, tag)) if !tag.contains('/') => (name, Some(tag)),
        _ => (name_tag, None),
    };
    if let Some(tag) = tag {
        check_tag(tag).map_err(fail)?;
    }
    if name.is_empty() {
        return Err(fail(RefProblem::EmptyName));
    }
    let (domain, remainder) = split_domain(name);
    let domain = match domain {
        Some(d) => {
            check_domain(d).map_err(fail)?;
            if d == LEGACY_DEFAULT_DOMAIN {
                DEFAULT_DOMAIN
            } else {
                d
            }
        }
        None => DEFAULT_DOMAIN,
    };
    check_path(remainder).map_err(fail)?;
    let path = if domain == DEFAULT_DOMAIN && !remainder.contains('/') {
        format!("{OFFICIAL_PREFIX}{remainder}")
    } else {
        remainder.to_string()
    };
    let len = domain.len() + 1 + path.len();
    if len > NAME_TOTAL_LENGTH_MAX {
        return Err(fail(RefProblem::NameTooLong { len }));
    }
    Ok(ImageRef { domain: domain.to_string(), path, tag: tag.map(str::to_string), digest: digest.map(str::to_string) })
}

/// Docker's rule for telling `host/name` from `user/name`: the first component is a domain only
/// if it could not be a Docker Hub user (a '.', a ':', `localhost`, or an uppercase letter).
pub(crate) fn split_domain(name: &str) -> (Option<&str>, &str) {
    match name.split_once('/') {
        Some((first, rest)) if looks_like_domain(first) => (Some(first), rest),
        _ => (None, name),
    }
}

pub(crate) fn looks_like_domain(first: &str) -> bool {
    first.contains(['.', ':']) || first == "localhost" || first.bytes().any(|b| b.is_ascii_uppercase())
}

/// `host[:port]`, where host is dot-separated labels or a bracketed IPv6 address.
pub(crate) fn check_domain(domain: &str) -> Result<(), RefProblem> {
    let bad = |why| RefProblem::BadDomain { domain: domain.to_string(), why };
    let (host, port) = if let Some(rest) = domain.strip_prefix('[') {
        let (inside, after) = rest.split_once(']').ok_or_else(|| bad("'[' without a closing ']'"))?;
        if inside.is_empty() || !inside.bytes().all(|b| b.is_ascii_hexdigit() || b == b':') {
            return Err(bad("a bracketed host must be an IPv6 address"));
        }
        let port = match after {
            "" => None,
            _ => Some(after.strip_prefix(':').ok_or_else(|| bad("expected ':<port>' after ']'"))?),
        };
        (None, port)
    } else {
        match domain.split_once(':') {
            Some((h, p)) => (Some(h), Some(p)),
            None => (Some(domain), None),
        }
    };
    if let Some(host) = host {
        for label in host.split('.') {
            let bytes = label.as_bytes();
            let ok = !bytes.is_empty()
                && bytes.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'-')
                && bytes[0] != b'-'
                && bytes[bytes.len() - 1] != b'-';
            if !ok {
                return Err(bad("host labels are letters, digits and inner '-', separated by '.'"));
            }
        }
    }
    if let Some(port) = port {
        if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad("the port must be digits"));
        }
    }
    Ok(())
}

/// The `/`-separated path after the domain.
pub(crate) fn check_path(path: &str) -> Result<(), RefProblem> {
    if path.bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(RefProblem::Uppercase);
    }
    for component in path.split('/') {
        if component.is_empty() {
            return Err(RefProblem::EmptyComponent { name: path.to_string() });
        }
        if !valid_component(component) {
            return Err(RefProblem::BadComponent { component: component.to_string() });
        }
    }
    Ok(())
}

/// `[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*`
fn valid_component(component: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    // Splitting at each alphanumeric leaves the separators, and "" between two alphanumerics
    // (which the dash rule accepts: a run of no dashes).
    component.starts_with(alnum)
        && component.ends_with(alnum)
        && component.split(alnum).all(|sep| matches!(sep, "." | "_" | "__") || sep.bytes().all(|b| b == b'-'))
}

/// `[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`
fn check_tag(tag: &str) -> Result<(), RefProblem> {
    let bad = |why| RefProblem::BadTag { tag: tag.to_string(), why };
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let Some(&first) = tag.as_bytes().first() else {
        return Err(bad("it is empty — drop the ':' or write a tag"));
    };
    if !word(first) {
        return Err(bad("it must start with a letter, digit or '_'"));
    }
    if !tag.bytes().all(|b| word(b) || b == b'.' || b == b'-') {
        return Err(bad("it may hold only letters, digits, '_', '.' and '-'"));
    }
    if tag.len() > TAG_LENGTH_MAX {
        return Err(bad("it is longer than 128 characters"));
    }
    Ok(())
}

fn check_digest(digest: &str) -> Result<(), RefProblem> {
    let bad = || RefProblem::BadDigest { digest: digest.to_string() };
    let (algorithm, hex) = digest.split_once(':').ok_or_else(bad)?;
    if algorithm != "sha256" {
        let known_shape = !algorithm.is_empty()
            && algorithm.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+._-".contains(&b));
        return Err(if known_shape {
            RefProblem::UnsupportedDigest { algorithm: algorithm.to_string() }
        } else {
            bad()
        });
    }
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return Err(bad());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn components_follow_the_separator_rules() {
        for ok in ["a", "a0", "a.b", "a_b", "a__b", "a-b", "a---b", "a.b_c-d"] {
            assert!(valid_component(ok), "{ok} should be valid");
        }
        for bad in ["", ".a", "a.", "a..b", "a___b", "a._b", "a-.b", "-a", "a-", "a+b"] {
            assert!(!valid_component(bad), "{bad} should be invalid");
        }
    }

    #[test]
    fn domains_accept_ports_and_ipv6() {
        for ok in ["docker.io", "127.0.0.1:5000", "localhost", "localhost:5000", "[::1]:5000", "[::1]", "My-Reg.io"] {
            assert_eq!(check_domain(ok), Ok(()), "{ok}");
        }
        for bad in ["reg.io:", "reg.io:50a", "-reg.io", "reg..io", "[::1", "[zz]:5000", "[::1]5000"] {
            assert!(check_domain(bad).is_err(), "{bad} should be invalid");
        }
    }
}
