//! The farm id (DESIGN.md "Where state lives"): every image a farm builds carries
//! `kiln.dev/farm=<id>`, and a farm only counts its own images as held and only sweeps its own.
//!
//! For the embedded default the id is derived from the user and the `$KILN_HOME` path rather than
//! stored in the state, so a wiped state still recognizes what it built, and two users (or two
//! homes) sharing one Docker daemon never sweep each other's images.

/// The embedded farm's id: `home-<12 hex>` from `user` and the absolute `$KILN_HOME` path.
pub fn embedded_farm_id(user: &str, kiln_home: &std::path::Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut h = blake3::Hasher::new();
    h.update(b"kiln-farm-v1\0");
    h.update(&(user.len() as u64).to_le_bytes());
    h.update(user.as_bytes());
    h.update(kiln_home.as_os_str().as_bytes());
    format!("home-{}", &h.finalize().to_hex()[..12])
}

/// The farm CA's fingerprint (`sha256:<64 hex>`) a join token (`kjoin_<id>_<secret>_<hex>`)
/// carries: what a new agent trusts on its first connection, before it has a certificate.
pub fn join_token_pin(token: &str) -> Option<String> {
    let rest = token.trim().strip_prefix("kjoin_")?;
    let (_, pin) = rest.rsplit_once('_')?;
    (pin.len() == 64 && pin.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| format!("sha256:{}", pin.to_ascii_lowercase()))
}

#[cfg(test)]
mod tests {
    use super::embedded_farm_id;

    #[test]
    fn a_join_token_names_the_ca_to_pin() {
        let pin = "ab".repeat(32);
        assert_eq!(super::join_token_pin(&format!("kjoin_0123456789ab_se_cr_et_{pin}")), Some(format!("sha256:{pin}")));
        assert_eq!(super::join_token_pin(&format!("kiln_0123456789ab_x_{pin}")), None);
        assert_eq!(super::join_token_pin("kjoin_x_y_short"), None);
    }
    use std::path::Path;

    #[test]
    fn the_id_depends_on_user_and_home_only() {
        let a = embedded_farm_id("ana", Path::new("/home/ana/.local/share/kiln"));
        assert_eq!(a, embedded_farm_id("ana", Path::new("/home/ana/.local/share/kiln")));
        assert_ne!(a, embedded_farm_id("bo", Path::new("/home/ana/.local/share/kiln")));
        assert_ne!(a, embedded_farm_id("ana", Path::new("/srv/kiln")));
        assert!(a.starts_with("home-") && a.len() == 17, "{a}");
    }
}
