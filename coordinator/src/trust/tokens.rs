//! Bearer tokens for users and one-time join tokens for agents.
//!
//! A token is `kiln_<id>_<secret>`: `id` (12 hex) finds the row, `secret` is 256 random bits. Only
//! the SHA-256 of the secret is stored. Not argon2: a slow hash protects secrets people choose,
//! which can be guessed; 256 random bits cannot be, so a fast hash loses nothing and keeps a check
//! on every call well under a millisecond. The comparison is constant-time.
//!
//! A join token is `kjoin_<id>_<secret>_<ca fingerprint hex>`: the agent learns from the token
//! itself which CA to trust on its first connection, before it has any certificate.

use base64::Engine;
use sha2::{Digest, Sha256};

/// A freshly made secret: what is shown once, and what is stored.
#[derive(Debug, Clone)]
pub struct Minted {
    /// The whole token, shown once.
    pub token: String,
    pub id: String,
    pub hash: String,
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    // rustls's ring is the crypto provider already linked; its system RNG is a CSPRNG.
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .expect("the system's random source works");
    bytes
}

fn secret() -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(random_bytes::<32>())
}

fn id() -> String {
    hex::encode(random_bytes::<6>())
}

pub fn hash(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// A new user token.
pub fn mint() -> Minted {
    let (id, secret) = (id(), secret());
    Minted { token: format!("kiln_{id}_{secret}"), hash: hash(&secret), id }
}

/// A new join token carrying the CA's fingerprint (`sha256:<hex>`).
pub fn mint_join(ca_fingerprint: &str) -> Minted {
    let (id, secret) = (id(), secret());
    let pin = ca_fingerprint.trim_start_matches("sha256:");
    Minted { token: format!("kjoin_{id}_{secret}_{pin}"), hash: hash(&secret), id }
}

/// `(id, secret)` of a user token; `None` when it is not one.
pub fn parse(token: &str) -> Option<(&str, &str)> {
    let rest = token.trim().strip_prefix("kiln_")?;
    let (id, secret) = rest.split_once('_')?;
    (id.len() == 12 && !secret.is_empty()).then_some((id, secret))
}

/// `(id, secret, ca fingerprint as sha256:<hex>)` of a join token.
pub fn parse_join(token: &str) -> Option<(&str, &str, String)> {
    let rest = token.trim().strip_prefix("kjoin_")?;
    let (id, rest) = rest.split_once('_')?;
    // The secret is base64url and may hold `_`; the fingerprint is the last 64 hex characters.
    let (secret, pin) = rest.rsplit_once('_')?;
    let ok = id.len() == 12 && !secret.is_empty() && pin.len() == 64 && pin.bytes().all(|b| b.is_ascii_hexdigit());
    ok.then(|| (id, secret, format!("sha256:{pin}")))
}

/// Whether `secret` hashes to `stored`, in time independent of where they differ.
pub fn matches(secret: &str, stored: &str) -> bool {
    let computed = hash(secret);
    computed.len() == stored.len() && computed.bytes().zip(stored.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_parses_back_and_only_its_secret_matches_the_stored_hash() {
        let minted = mint();
        let (id, secret) = parse(&minted.token).unwrap();
        assert_eq!(id, minted.id);
        assert!(matches(secret, &minted.hash));
        assert!(!matches("not-it", &minted.hash));
        assert!(!minted.hash.contains(secret), "only the hash is kept");
        assert_ne!(mint().token, minted.token);
        assert_eq!(parse("kiln_short_x"), None);
        assert_eq!(parse("bearer"), None);
    }

    #[test]
    fn a_join_token_carries_the_ca_it_must_be_used_with() {
        let pin = format!("sha256:{}", "ab".repeat(32));
        let minted = mint_join(&pin);
        let (id, secret, fingerprint) = parse_join(&minted.token).unwrap();
        assert_eq!((id, fingerprint.as_str()), (minted.id.as_str(), pin.as_str()));
        assert!(matches(secret, &minted.hash));
        assert_eq!(parse_join(&minted.token.replace("kjoin_", "kiln_")), None);
        assert_eq!(parse(&minted.token), None, "a join token is not a user token");
    }
}
