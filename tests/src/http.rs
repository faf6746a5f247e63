//! A plain HTTP/1.0 client for the coordinator's `--http` listener: one request per connection,
//! every header of the answer kept (a test reads `Set-Cookie` and `Location` as a browser would).

use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One answer.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Names lowercased, in the order sent.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    /// The first header `name` (lowercase), if sent.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// Sends `method path` with `headers` and `body` (a form, when given) and reads the whole answer.
pub async fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Response {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    let mut head = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if !body.is_empty() {
        head.push_str(&format!(
            "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body.as_bytes()).await.unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await.unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP answer: {raw}"));
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split_whitespace().nth(1)).and_then(|s| s.parse().ok()).unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Response { status, headers, body: body.to_string() }
}

/// `GET path`, with a `Cookie` header when `cookie` is given.
pub async fn get(addr: SocketAddr, path: &str, cookie: Option<&str>) -> Response {
    let cookie = cookie.map(|c| format!("kiln_session={c}"));
    let headers: Vec<(&str, &str)> = cookie.iter().map(|c| ("Cookie", c.as_str())).collect();
    request(addr, "GET", path, &headers, "").await
}

/// `application/x-www-form-urlencoded` for one value: what a browser posts for it.
pub fn form_value(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'*' => (b as char).to_string(),
            b' ' => "+".to_string(),
            other => format!("%{other:02X}"),
        })
        .collect()
}
