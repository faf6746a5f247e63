//! Platforms: `os/arch[/variant]` canonicalized into the short token a content tag carries.
//!
//! Two spellings of one platform must give one token, or the same content would get two tags (and
//! the second build would be a needless rebuild). So aliases collapse (`x86_64` → `amd64`,
//! `aarch64` → `arm64`, `i386`/`i686` → `386`), default variants are filled in or dropped as
//! containerd does (`arm` → `armv7`, `arm64/v8` → `arm64`, `amd64/v1` → `amd64`), `linux` — the
//! only os most images have — is left out of the token, and any other os is a prefix
//! (`windows/amd64` → `windows-amd64`). Tokens are `[a-z0-9-]`; a set of them joins with `.`
//! (`amd64.arm64`), which no token contains, so the joined form is unambiguous.

use std::cmp::Ordering;
use std::fmt;

/// Operating systems Go (and so Docker and containerd) knows; an os outside it is a typo.
const KNOWN_OS: &[&str] = &[
    "aix",
    "android",
    "darwin",
    "dragonfly",
    "freebsd",
    "illumos",
    "ios",
    "js",
    "linux",
    "netbsd",
    "openbsd",
    "plan9",
    "solaris",
    "wasip1",
    "windows",
];

/// Architectures Go knows, after aliases are applied.
const KNOWN_ARCH: &[&str] = &[
    "386", "amd64", "arm", "arm64", "loong64", "mips", "mipsle", "mips64", "mips64le", "ppc64", "ppc64le", "riscv64",
    "s390x", "wasm",
];

/// One canonical platform. Ordered by its token, so a [`PlatformSet`] sorts as its tag reads.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Platform {
    os: String,
    arch: String,
    variant: Option<String>,
}

impl Platform {
    /// Parses `os/arch[/variant]` or `arch[/variant]` (os `linux`).
    pub fn parse(input: &str) -> Result<Platform, PlatformError> {
        if input.is_empty() {
            return Err(PlatformError::Empty);
        }
        let parts: Vec<&str> = input.split('/').collect();
        // '_' only so that the alias `x86_64` parses; os and arch must then be known names, and the
        // variant is checked below, so no token ever carries one.
        let bad_part = |part: &str| PlatformError::BadPart { input: input.to_string(), part: part.to_string() };
        for part in &parts {
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
                return Err(bad_part(part));
            }
        }
        let (os, arch, variant) = match parts.as_slice() {
            [arch] => ("linux", *arch, None),
            // `linux/arm64` and `arm64/v8` both have two parts: a known os decides.
            [first, second] if KNOWN_OS.contains(first) => (*first, *second, None),
            [arch, variant] => ("linux", *arch, Some(*variant)),
            [os, arch, variant] => (*os, *arch, Some(*variant)),
            _ => return Err(PlatformError::Shape { input: input.to_string() }),
        };
        if !KNOWN_OS.contains(&os) {
            return Err(PlatformError::UnknownOs { input: input.to_string(), os: os.to_string() });
        }
        let (arch, variant) = canonical_arch(arch, variant);
        if !KNOWN_ARCH.contains(&arch) {
            return Err(PlatformError::UnknownArch {
                input: input.to_string(),
                arch: arch.to_string(),
                // `linx/amd64` reads as arch `linx`: say it may be a misspelt os.
                maybe_os: parts.len() == 2 && !KNOWN_OS.contains(&parts[0]),
            });
        }
        if let Some(v) = variant.as_deref().filter(|v| v.contains('_')) {
            return Err(bad_part(v));
        }
        Ok(Platform { os: os.to_string(), arch: arch.to_string(), variant })
    }

    /// Linux on this machine's architecture: the images a build host runs natively (on macOS and
    /// Windows too, whose Docker runs Linux containers in a VM of the host's architecture).
    pub fn host() -> Platform {
        let arch = go_arch(std::env::consts::ARCH, cfg!(target_endian = "little"));
        let (arch, variant) = canonical_arch(arch, None);
        Platform { os: "linux".to_string(), arch: arch.to_string(), variant }
    }

    pub fn os(&self) -> &str {
        &self.os
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    pub fn variant(&self) -> Option<&str> {
        self.variant.as_deref()
    }

    /// The short form a content tag carries: `amd64`, `armv7`, `arm64v9`, `windows-amd64`.
    pub fn token(&self) -> String {
        let mut token = String::new();
        if self.os != "linux" {
            token.push_str(&self.os);
            token.push('-');
        }
        token.push_str(&self.arch);
        if let Some(variant) = &self.variant {
            token.push_str(variant);
        }
        token
    }

    /// The OCI form Docker's `--platform` takes: `linux/amd64`, `linux/arm/v7`.
    pub fn oci(&self) -> String {
        match &self.variant {
            Some(variant) => format!("{}/{}/{variant}", self.os, self.arch),
            None => format!("{}/{}", self.os, self.arch),
        }
    }
}

/// Go's name for Rust's `target_arch` (which says nothing of byte order, hence `little_endian`).
/// A function of its arguments rather than of the build target, so that every arm is tested on any
/// host.
fn go_arch(rust_arch: &str, little_endian: bool) -> &str {
    match rust_arch {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "loongarch64" => "loong64",
        "powerpc64" if little_endian => "ppc64le",
        "powerpc64" => "ppc64",
        "mips64" if little_endian => "mips64le",
        "mips" if little_endian => "mipsle",
        other => other,
    }
}

/// Applies aliases and containerd's default variants.
fn canonical_arch<'a>(arch: &'a str, variant: Option<&str>) -> (&'a str, Option<String>) {
    let arch = match arch {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "i386" | "i686" => "386",
        other => other,
    };
    // containerd writes ARM variants as `v<N>` but accepts the bare number.
    let versioned = |v: &str| {
        if v.bytes().all(|b| b.is_ascii_digit()) {
            format!("v{v}")
        } else {
            v.to_string()
        }
    };
    let variant = match (arch, variant) {
        ("arm", None) => Some("v7".to_string()),
        ("arm", Some(v)) => Some(versioned(v)),
        ("arm64", Some(v)) if versioned(v) == "v8" => None,
        ("arm64", Some(v)) => Some(versioned(v)),
        ("amd64", Some("v1")) => None,
        (_, v) => v.map(str::to_string),
    };
    (arch, variant)
}

impl Ord for Platform {
    fn cmp(&self, other: &Self) -> Ordering {
        self.token().cmp(&other.token()).then_with(|| self.oci().cmp(&other.oci()))
    }
}

impl PartialOrd for Platform {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.token())
    }
}

impl fmt::Debug for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Platform({})", self.oci())
    }
}

/// A non-empty, sorted, deduplicated set of platforms. Displays as the tokens joined with `.`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PlatformSet(Vec<Platform>);

impl PlatformSet {
    /// Sorts and deduplicates; an empty set is an error, since an image must be built for something.
    pub fn new(platforms: impl IntoIterator<Item = Platform>) -> Result<PlatformSet, PlatformError> {
        let mut platforms: Vec<Platform> = platforms.into_iter().collect();
        platforms.sort();
        platforms.dedup();
        if platforms.is_empty() {
            return Err(PlatformError::NoPlatforms);
        }
        Ok(PlatformSet(platforms))
    }

    /// Parses each of `inputs` with [`Platform::parse`].
    pub fn parse<'a>(inputs: impl IntoIterator<Item = &'a str>) -> Result<PlatformSet, PlatformError> {
        let platforms = inputs.into_iter().map(Platform::parse).collect::<Result<Vec<_>, _>>()?;
        PlatformSet::new(platforms)
    }

    /// The set holding only [`Platform::host`].
    pub fn host() -> PlatformSet {
        PlatformSet(vec![Platform::host()])
    }

    pub fn iter(&self) -> impl Iterator<Item = &Platform> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always false: a set is never empty. Present because `len` is.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The OCI forms joined with `,`, as `docker buildx build --platform` takes them.
    pub fn oci(&self) -> String {
        self.0.iter().map(Platform::oci).collect::<Vec<_>>().join(",")
    }
}

impl fmt::Display for PlatformSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tokens: Vec<String> = self.0.iter().map(Platform::token).collect();
        f.write_str(&tokens.join("."))
    }
}

impl fmt::Debug for PlatformSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PlatformSet({self})")
    }
}

/// Why a platform (or a set of them) is invalid. Each variant names the input.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlatformError {
    #[error("platform \"\": empty — write os/arch[/variant], e.g. linux/amd64")]
    Empty,
    #[error("platform {input:?}: expected os/arch[/variant] or arch[/variant], e.g. linux/arm64")]
    Shape { input: String },
    #[error("platform {input:?}: part {part:?} must be lowercase letters and digits")]
    BadPart { input: String, part: String },
    #[error("platform {input:?}: unknown os {os:?} — expected one of {}", KNOWN_OS.join(", "))]
    UnknownOs { input: String, os: String },
    #[error(
        "platform {input:?}: {arch:?} is not a known {} — expected one of {}",
        if *maybe_os { "os or architecture" } else { "architecture" },
        KNOWN_ARCH.join(", ")
    )]
    UnknownArch { input: String, arch: String, maybe_os: bool },
    #[error("no platforms — list at least one, e.g. \"linux/amd64\"")]
    NoPlatforms,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(input: &str) -> String {
        Platform::parse(input).unwrap().token()
    }

    #[test]
    fn tokens_are_canonical() {
        let cases = [
            ("linux/amd64", "amd64"),
            ("amd64", "amd64"),
            ("x86_64", "amd64"),
            ("linux/x86_64", "amd64"),
            ("amd64/v1", "amd64"),
            ("amd64/v3", "amd64v3"),
            ("aarch64", "arm64"),
            ("linux/arm64/v8", "arm64"),
            ("arm64/v8", "arm64"),
            ("arm64/8", "arm64"),
            ("arm64/v9", "arm64v9"),
            ("arm", "armv7"),
            ("linux/arm", "armv7"),
            ("arm/v7", "armv7"),
            ("arm/7", "armv7"),
            ("arm/v6", "armv6"),
            ("i386", "386"),
            ("i686", "386"),
            ("windows/amd64", "windows-amd64"),
            ("riscv64", "riscv64"),
        ];
        for (input, want) in cases {
            assert_eq!(token(input), want, "{input}");
        }
    }

    #[test]
    fn oci_form_keeps_the_variant_docker_needs() {
        assert_eq!(Platform::parse("arm").unwrap().oci(), "linux/arm/v7");
        assert_eq!(Platform::parse("arm64/v8").unwrap().oci(), "linux/arm64");
        assert_eq!(Platform::parse("x86_64").unwrap().oci(), "linux/amd64");
        assert_eq!(Platform::parse("windows/amd64").unwrap().oci(), "windows/amd64");
    }

    #[test]
    fn every_token_is_lowercase_alnum_and_dash() {
        for os in KNOWN_OS {
            for arch in KNOWN_ARCH {
                let t = token(&format!("{os}/{arch}"));
                assert!(t.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'), "{t}");
            }
        }
    }

    #[test]
    fn host_platform_is_known() {
        let host = Platform::host();
        assert!(KNOWN_ARCH.contains(&host.arch()), "{host:?}");
        assert_eq!(Platform::parse(&host.oci()).unwrap(), host);
    }

    #[test]
    fn go_arch_names_each_rust_arch_as_go_does_in_either_byte_order() {
        let cases = [
            ("x86_64", "amd64", "amd64"),
            ("aarch64", "arm64", "arm64"),
            ("x86", "386", "386"),
            ("arm", "arm", "arm"),
            ("loongarch64", "loong64", "loong64"),
            ("powerpc64", "ppc64le", "ppc64"),
            ("mips64", "mips64le", "mips64"),
            ("mips", "mipsle", "mips"),
            ("riscv64", "riscv64", "riscv64"),
            ("s390x", "s390x", "s390x"),
        ];
        for (rust, little, big) in cases {
            assert_eq!(go_arch(rust, true), little, "{rust}, little-endian");
            assert_eq!(go_arch(rust, false), big, "{rust}, big-endian");
        }
    }

    #[test]
    fn bad_platforms_name_the_input() {
        let err = |s| Platform::parse(s).unwrap_err().to_string();
        assert!(err("Linux/amd64").contains(r#"platform "Linux/amd64": part "Linux" must be lowercase"#));
        assert!(err("linux/amd64/v2/x").contains("expected os/arch[/variant]"));
        assert!(err("linx/amd64").contains(r#""linx" is not a known os or architecture"#));
        assert!(err("amd46").contains(r#""amd46" is not a known architecture"#));
        assert!(err("plan10/amd64/v1").contains(r#"unknown os "plan10""#));
        assert!(err("linux//amd64").contains(r#"part """#));
        assert!(err("linux/arm-64").contains(r#"part "arm-64""#));
        assert!(err("arm64/v_9").contains(r#"part "v_9""#));
        assert!(err("linux/arm_64").contains(r#""arm_64" is not a known architecture"#));
        assert_eq!(Platform::parse(""), Err(PlatformError::Empty));
    }

    #[test]
    fn sets_sort_dedupe_and_refuse_empty() {
        let set = PlatformSet::parse(["linux/arm64", "amd64", "x86_64", "arm64/v8"]).unwrap();
        assert_eq!(set.to_string(), "amd64.arm64");
        assert_eq!(set.len(), 2);
        assert_eq!(set.oci(), "linux/amd64,linux/arm64");
        assert_eq!(PlatformSet::parse([]), Err(PlatformError::NoPlatforms));
        let other_order = PlatformSet::parse(["arm64", "amd64"]).unwrap();
        assert_eq!(set, other_order);
    }
}
