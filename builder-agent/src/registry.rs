//! The registry probe behind "recorded means present" for a `registry` target: one manifest
//! `HEAD` per ref, all at once, answered 200 or not. The agent asks because it is the one that
//! pushed there and can reach it; the coordinator only learns which refs must be pushed again.
//!
//! Scheme as Docker picks it: plain HTTP for loopback registries (which Docker allows insecure by
//! default), HTTPS with the system's roots for every other one. A registry that wants a token gets
//! the anonymous one its `WWW-Authenticate` challenge offers, as `docker pull` would ask for; one
//! that still refuses counts as "absent", so the converge pushes through the daemon, which holds
//! the credentials — safe, never a skip on a guess.

use std::time::Duration;

use futures_util::future::join_all;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use kiln_core::refs::ImageRef;

/// A probe that takes longer than this counts as "absent": the push that follows decides.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Every manifest type a registry may serve a tag as; without them some answer 404 for an index.
const ACCEPT: &str = "application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json, \
     application/vnd.docker.distribution.manifest.list.v2+json, application/vnd.docker.distribution.manifest.v2+json";

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Empty<Bytes>>;

/// Probes every ref; per ref, whether its manifest is there, or why it could not be told.
pub(crate) async fn probe(references: &[String]) -> Vec<Result<bool, String>> {
    let client = match client() {
        Ok(client) => client,
        Err(why) => return references.iter().map(|_| Err(why.clone())).collect(),
    };
    join_all(references.iter().map(|r| async {
        match tokio::time::timeout(PROBE_TIMEOUT, present(&client, r)).await {
            Ok(answer) => answer,
            Err(_) => Err(format!("the registry did not answer within {} s", PROBE_TIMEOUT.as_secs())),
        }
    }))
    .await
}

fn client() -> Result<HttpsClient, String> {
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_native_roots()
        .map_err(|err| format!("no system root certificates: {err}"))?
        .https_or_http()
        .enable_http1()
        .build();
    Ok(Client::builder(TokioExecutor::new()).build(https))
}

/// `http://127.0.0.1:5000/v2/team/app/manifests/<tag>` for `127.0.0.1:5000/team/app:<tag>`.
fn manifest_url(reference: &str) -> Result<String, String> {
    let parsed = ImageRef::parse(reference).map_err(|err| kiln_core::error_chain(&err))?;
    let tag = parsed.tag().ok_or_else(|| format!("{reference} names no tag"))?;
    let domain = match parsed.domain() {
        "docker.io" => "registry-1.docker.io",
        other => other,
    };
    let host = domain.rsplit_once(':').map_or(domain, |(host, _)| host).trim_matches(['[', ']']);
    let loopback = host == "localhost" || host.starts_with("127.") || host == "::1";
    let scheme = if loopback { "http" } else { "https" };
    Ok(format!("{scheme}://{domain}/v2/{}/manifests/{tag}", parsed.path()))
}

async fn present(client: &HttpsClient, reference: &str) -> Result<bool, String> {
    let url = manifest_url(reference)?;
    let status = head(client, &url, None).await?;
    if status != http::StatusCode::UNAUTHORIZED.as_u16() {
        return answer(status, &url);
    }
    // Ask once more with the anonymous token the challenge names.
    let token = anonymous_token(client, &url).await?;
    answer(head(client, &url, Some(&token)).await?, &url)
}

fn answer(status: u16, url: &str) -> Result<bool, String> {
    match status {
        200 => Ok(true),
        404 => Ok(false),
        other => Err(format!("HEAD {url} answered {other}")),
    }
}

async fn head(client: &HttpsClient, url: &str, token: Option<&str>) -> Result<u16, String> {
    let mut request = http::Request::head(url).header("accept", ACCEPT);
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let request = request.body(Empty::new()).map_err(|err| err.to_string())?;
    let response =
        client.request(request).await.map_err(|err| format!("HEAD {url}: {}", kiln_core::error_chain(&err)))?;
    Ok(response.status().as_u16())
}

/// The anonymous pull token a registry's `WWW-Authenticate: Bearer realm=…,service=…,scope=…`
/// challenge offers.
async fn anonymous_token(client: &HttpsClient, url: &str) -> Result<String, String> {
    let request = http::Request::head(url).header("accept", ACCEPT).body(Empty::new()).map_err(|e| e.to_string())?;
    let response =
        client.request(request).await.map_err(|err| format!("HEAD {url}: {}", kiln_core::error_chain(&err)))?;
    let challenge = response
        .headers()
        .get("www-authenticate")
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| format!("{url} wants credentials and names no token service"))?;
    let params = challenge_params(challenge).ok_or_else(|| format!("{url} wants credentials: {challenge}"))?;
    let realm = params.iter().find(|(k, _)| k == "realm").map(|(_, v)| v.clone()).ok_or("no realm")?;
    let query: Vec<String> = params
        .iter()
        .filter(|(k, _)| k == "service" || k == "scope")
        .map(|(k, v)| format!("{k}={}", v.replace(' ', "%20")))
        .collect();
    let token_url = if query.is_empty() { realm } else { format!("{realm}?{}", query.join("&")) };
    let request = http::Request::get(&token_url).body(Empty::new()).map_err(|e| e.to_string())?;
    let response =
        client.request(request).await.map_err(|err| format!("GET {token_url}: {}", kiln_core::error_chain(&err)))?;
    if !response.status().is_success() {
        return Err(format!("GET {token_url} answered {}", response.status()));
    }
    let body = response.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    json.get("token")
        .or_else(|| json.get("access_token"))
        .and_then(|t| t.as_str())
        .map(str::to_string)
        .ok_or_else(|| format!("{token_url} gave no token"))
}

/// `Bearer realm="https://auth",service="reg",scope="repository:x:pull"` → its key/value pairs.
fn challenge_params(challenge: &str) -> Option<Vec<(String, String)>> {
    let rest = challenge.strip_prefix("Bearer ")?;
    let mut out = Vec::new();
    for part in rest.split("\",") {
        let (key, value) = part.split_once('=')?;
        out.push((key.trim().to_string(), value.trim().trim_matches('"').to_string()));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_registries_are_plain_http_and_others_https() {
        assert_eq!(
            manifest_url("127.0.0.1:5000/team/app:t1").unwrap(),
            "http://127.0.0.1:5000/v2/team/app/manifests/t1"
        );
        assert_eq!(manifest_url("localhost:5000/app:t").unwrap(), "http://localhost:5000/v2/app/manifests/t");
        assert_eq!(manifest_url("reg.example.com/app:t").unwrap(), "https://reg.example.com/v2/app/manifests/t");
        assert_eq!(manifest_url("app:t").unwrap(), "https://registry-1.docker.io/v2/library/app/manifests/t");
        assert!(manifest_url("app@sha256:0").is_err());
    }

    #[test]
    fn a_bearer_challenge_reads_as_its_parameters() {
        let params = challenge_params(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull""#,
        )
        .unwrap();
        assert_eq!(params[0], ("realm".to_string(), "https://auth.example/token".to_string()));
        assert_eq!(params[2], ("scope".to_string(), "repository:a/b:pull".to_string()));
        assert_eq!(challenge_params("Basic realm=x"), None);
    }
}
