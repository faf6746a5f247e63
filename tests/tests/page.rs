//! The status page (`kiln-coordinator --http`): who may see it, and what a person sees.
//!
//! - Its login, attacked over plain HTTP against a TLS coordinator: no cookie, forged cookies, a
//!   wrong, expired or revoked token are all refused, and refusals change nothing.
//! - A real browser (headless Chromium through chromedriver) watches real converges on the real
//!   Docker daemon: the converge appears, runs, turns to succeeded, the record shows the new ref,
//!   the byte ledger and a gc show up; markup in names is text; a phone-sized window does not
//!   scroll sideways. Screenshots land in the test's temp dir (and in `$KILN_SCREENSHOTS`, if set).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder};
use kiln_coordinator::model::{ConvergeState, EventKind, RecordedImage, RecordedKind};
use kiln_coordinator::state::{SqliteStore, StateStore};
use kiln_coordinator::trust::{pki, Role};
use kiln_e2e::browser::ChromeDriver;
use kiln_e2e::fixture::{example, reference, remove_built, unique, write};
use kiln_e2e::http::{form_value, get, request, Response};
use kiln_e2e::trust::TrustedFarm;
use kiln_e2e::wire::{gc, succeeded, up};
use kiln_e2e::Farm;
use serde_json::{json, Value};

/// Waits until the listener answers: the coordinator binds it as it starts serving.
async fn listening(addr: SocketAddr) {
    for _ in 0..400 {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("nothing listens on {addr}");
}

/// Posts `token` to the login form, as the browser does.
async fn log_in(http: SocketAddr, token: &str, headers: &[(&str, &str)]) -> Response {
    request(http, "POST", "/login", headers, &format!("token={}", form_value(token))).await
}

/// The session id a login's `Set-Cookie` carries.
fn session_of(response: &Response) -> String {
    let cookie = response.header("set-cookie").unwrap_or_else(|| panic!("no cookie: {response:?}"));
    cookie.strip_prefix("kiln_session=").and_then(|c| c.split(';').next()).unwrap().to_string()
}

/// Refused as the page refuses: `/` sends to the login form, its JSON answers 401; no cookie set.
async fn refused(http: SocketAddr, cookie: Option<&str>, why: &str) {
    let page = get(http, "/", cookie).await;
    assert_eq!((page.status, page.header("location")), (303, Some("/login")), "{why}: {page:?}");
    assert!(page.header("set-cookie").is_none(), "{why}: {page:?}");
    for path in ["/api/status", "/api/converges/x/events?after=0"] {
        let api = get(http, path, cookie).await;
        assert_eq!(api.status, 401, "{why}: {path}: {api:?}");
        assert!(api.body.contains("\"login\":\"/login\""), "{why}: {path}: {}", api.body);
        assert!(api.header("set-cookie").is_none(), "{why}: {path}: {api:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_needs_a_live_session_opened_with_a_token_and_refusals_change_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = TrustedFarm::start_observed(&tmp.path().join("state")).await;
    let http = farm.http.unwrap();
    listening(http).await;
    let viewer = farm.token("vera", Role::Viewer, None, None).await;
    let member = farm.token("mo", Role::Member, Some("payments"), None).await;
    let expired = farm.token("old", Role::Admin, None, Some(pki::now_ms() - 1)).await;

    // Nobody: sent to the form; the JSON says 401. Prometheus still scrapes without credentials.
    refused(http, None, "no cookie").await;
    let form = get(http, "/login", None).await;
    assert_eq!(form.status, 200);
    assert!(form.body.contains(r#"name="token""#), "{}", form.body);
    assert_eq!(get(http, "/metrics", None).await.status, 200);

    // Forged sessions: a guessed id, the token itself as the cookie (a session is not a token),
    // an empty one, one with a path in it.
    let guessed = "ab".repeat(32);
    for forged in [guessed.as_str(), viewer.as_str(), "", "../../kiln.db"] {
        refused(http, Some(forged), &format!("forged cookie {forged:?}")).await;
    }

    // Wrong and expired tokens open nothing.
    for (token, why) in [("kiln_nope_nope", "unknown token"), (expired.as_str(), "expired token"), ("", "empty")] {
        let answer = log_in(http, token, &[]).await;
        assert_eq!(answer.status, 401, "{why}: {answer:?}");
        assert!(answer.header("set-cookie").is_none(), "{why}: {answer:?}");
        assert!(answer.body.contains("not a valid token"), "{why}: {}", answer.body);
    }

    // A viewer's token opens a session: the cookie holds a session id, never the token, and is
    // HttpOnly and SameSite=Strict; Secure only when a TLS proxy says the browser spoke https.
    let answer = log_in(http, &viewer, &[]).await;
    assert_eq!((answer.status, answer.header("location")), (303, Some("/")), "{answer:?}");
    let cookie = answer.header("set-cookie").unwrap().to_string();
    assert!(cookie.contains("; HttpOnly") && cookie.contains("; SameSite=Strict"), "{cookie}");
    assert!(!cookie.contains("Secure") && !cookie.contains(&viewer), "{cookie}");
    let session = session_of(&answer);
    let page = get(http, "/", Some(&session)).await;
    assert_eq!(page.status, 200, "{page:?}");
    assert!(page.body.contains("user:vera (viewer)"), "{}", page.body);
    let policy = page.header("content-security-policy").unwrap();
    assert!(policy.contains("script-src 'sha256-") && policy.contains("frame-ancestors 'none'"), "{policy}");
    let status: Value = serde_json::from_str(&get(http, "/api/status", Some(&session)).await.body).unwrap();
    assert_eq!(status["farm"], json!(farm.farm));
    let proxied = log_in(http, &member, &[("X-Forwarded-Proto", "https")]).await;
    assert!(proxied.header("set-cookie").unwrap().ends_with("; Secure"), "{proxied:?}");
    let member_session = session_of(&proxied);
    assert_eq!(get(http, "/api/status", Some(&member_session)).await.status, 200, "a member is a viewer too");

    // Revoked: the open session stops within the token cache's 2 s, and the token logs in no more.
    let id = viewer.split('_').nth(1).unwrap();
    assert!(farm.store.revoke_token(id, pki::now_ms()).await.unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(http, "/api/status", Some(&session)).await.status != 401 {
        assert!(Instant::now() < deadline, "a revoked token's session still reads the page");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    refused(http, Some(&session), "revoked token's session").await;
    let again = log_in(http, &viewer, &[]).await;
    assert!(again.status == 401 && again.header("set-cookie").is_none(), "{again:?}");

    // Logging out ends the member's session.
    let out = request(http, "POST", "/logout", &[("Cookie", &format!("kiln_session={member_session}"))], "").await;
    assert!(out.header("set-cookie").unwrap().contains("Max-Age=0"), "{out:?}");
    refused(http, Some(&member_session), "logged out").await;

    // Nothing changed: no converge, no record, and the audit log holds the two logins and the
    // logout — none of the refusals, which anyone who reaches the port could send.
    assert!(farm.store.converges(None, 10).await.unwrap().is_empty());
    assert!(farm.store.records().await.unwrap().is_empty());
    let audit: Vec<(String, String)> =
        farm.store.audit(0, None).await.unwrap().into_iter().map(|r| (r.actor, r.action)).collect();
    let expected = [("user:vera", "login"), ("user:mo", "login"), ("user:mo", "logout")];
    assert_eq!(audit, expected.map(|(a, b)| (a.to_string(), b.to_string())), "{audit:?}");
    farm.stop().await;
}

/// Polls `script` (a function body given `args`) until it returns true.
async fn wait_for(client: &Client, what: &str, script: &str, args: Vec<Value>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match client.execute(script, args.clone()).await {
            Ok(Value::Bool(true)) => return,
            Ok(_) => {}
            Err(err) => eprintln!("{what}: {err}"),
        }
        if Instant::now() > deadline {
            let text = client.execute("return document.body.innerText", vec![]).await.unwrap_or_default();
            panic!("the page never showed {what}; it reads:\n{}", text.as_str().unwrap_or_default());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn run(client: &Client, script: &str, args: Vec<Value>) -> Value {
    client.execute(script, args).await.unwrap_or_else(|e| panic!("{script}: {e}"))
}

async fn screenshot(client: &Client, dir: &Path, name: &str) {
    let png = client.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG"), "{name} is a PNG");
    std::fs::write(dir.join(name), &png).unwrap();
    if let Some(keep) = std::env::var_os("KILN_SCREENSHOTS") {
        std::fs::create_dir_all(&keep).unwrap();
        std::fs::write(Path::new(&keep).join(name), &png).unwrap();
    }
}

/// True when the converge row of instance `arguments[0]` shows state `arguments[1]`.
const ROW_IS: &str = "const row = [...document.querySelectorAll('#converges tr[data-row]')]
    .find(r => r.querySelector('[data-label=instance]').textContent === arguments[0]);
  return !!row && row.querySelector('.state').textContent === arguments[1];";

/// True when the record of `arguments[0]` is at generation `arguments[1]` and names `arguments[2]`.
const RECORD_SHOWS: &str = "const record = [...document.querySelectorAll('.record')]
    .find(r => r.dataset.instance === arguments[0]);
  return !!record && record.querySelector('h3').textContent.includes('generation ' + arguments[1])
    && record.innerText.includes(arguments[2]);";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_person_watching_the_page_sees_a_converge_run_succeed_and_move_its_record() {
    let tmp = tempfile::tempdir().unwrap();
    let shots = tmp.path().join("screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let instance = unique("page");
    let dir = example("hello", tmp.path(), "hello", &instance, None);
    let mut farm = Farm::start_observed(&tmp.path().join("home")).await;
    let http = farm.coordinator_metrics.unwrap();
    listening(http).await;

    // Whatever the state holds is shown as text: markup in an instance, an image, a USER, a
    // requester, a failure's reason and an event (the state may be written by anything).
    let state = SqliteStore::open(farm.home.join("state").join("kiln.db")).unwrap();
    let evil = "<script>window.__pwned=1</script>";
    let image = RecordedImage {
        user: Some("<b>app</b>".into()),
        ..RecordedImage::passthrough(
            "<img src=x onerror=\"window.__pwned=2\">",
            "kiln-e2e/escape:1",
            RecordedKind::Built,
            "registry:127.0.0.1:1",
        )
    };
    state.write_record(evil, None, vec![image]).await.unwrap();
    let hostile = state.open_converge(evil, "<i>mallory</i>").await.unwrap();
    let note = "<img src=x onerror=\"window.__pwned=3\">";
    state.append_event(&hostile.id, EventKind::Note, None, note).await.unwrap();
    let failed = ConvergeState::Failed { reason: "<u>refused</u>".into() };
    state.finish_converge(&hostile.id, failed).await.unwrap();

    let driver = ChromeDriver::start(&tmp.path().join("chromedriver.log"));
    let caps = ChromeDriver::capabilities(1280, 1000, &tmp.path().join("chromium"));
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    let client =
        ClientBuilder::new(connector).capabilities(caps).connect(&driver.url).await.expect("a WebDriver session");
    let page = format!("http://{http}/");
    client.goto(&page).await.unwrap();
    wait_for(&client, "the page", "return document.querySelector('h1')?.textContent === 'Kiln'", vec![]).await;

    // The hostile converge's log, opened as a reader does: a click, the lines fetched as JSON.
    let id = hostile.id.to_string();
    run(&client, "document.querySelector(`a[data-converge='${arguments[0]}']`).click()", vec![json!(id)]).await;
    let shows_note = "return document.getElementById('log-lines').innerText.includes(arguments[0])";
    wait_for(&client, "the hostile event as text", shows_note, vec![json!(note)]).await;
    // Two live refreshes swap every section in again.
    tokio::time::sleep(Duration::from_millis(4500)).await;
    let escaped = run(
        &client,
        "const record = [...document.querySelectorAll('.record')].find(r => r.dataset.instance === arguments[0]);
         const text = document.querySelector('main').innerText;
         return { pwned: window.__pwned === undefined ? null : window.__pwned,
                  scripts: document.scripts.length,
                  images: document.images.length,
                  heading: record ? record.querySelector('h3').textContent : null,
                  shown: ['<b>app</b>', '<i>mallory</i>', '<u>refused</u>', arguments[1], arguments[2]]
                    .every(s => text.includes(s)) };",
        vec![json!(evil), json!("<img src=x onerror=\"window.__pwned=2\">"), json!(note)],
    )
    .await;
    assert_eq!(escaped["pwned"], Value::Null, "markup from the state ran: {escaped}");
    assert_eq!((escaped["scripts"].as_u64(), escaped["images"].as_u64()), (Some(1), Some(0)), "{escaped}");
    assert!(escaped["heading"].as_str().unwrap_or_default().starts_with(evil), "{escaped}");
    assert_eq!(escaped["shown"], json!(true), "{escaped}");

    // From here the log follows the newest converge, as for a reader who picked none.
    client.goto(&page).await.unwrap();

    // A first converge: it appears and turns to succeeded; the record names its refs.
    let first_web = reference(&dir, "web");
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    wait_for(&client, "the first converge succeeded", ROW_IS, vec![json!(instance), json!("succeeded")]).await;
    wait_for(&client, "generation 1", RECORD_SHOWS, vec![json!(instance), json!(1), json!(first_web)]).await;

    // One file changes and the build is held once Docker has it: the page shows the converge
    // running, its build on the agent, and the log following it.
    write(&dir, "web/index.html", "<p>changed by the page test</p>\n");
    let second_web = reference(&dir, "web");
    assert_ne!(first_web, second_web);
    farm.store.pause.armed.store(true, Ordering::SeqCst);
    let gate = farm.store.pause.gate.lock().await;
    let (url, converge_dir) = (farm.url.clone(), dir.clone());
    let converge = tokio::spawn(async move { up(&url, &converge_dir, false).await });
    tokio::time::timeout(Duration::from_secs(60), farm.store.pause.built.notified()).await.expect("the build ran");
    wait_for(&client, "the converge running", ROW_IS, vec![json!(instance), json!("running")]).await;
    let building = "return document.getElementById('converges').innerText.includes('building on e2e-agent')";
    wait_for(&client, "its build on the agent", building, vec![]).await;
    wait_for(
        &client,
        "the log following it",
        "const title = document.getElementById('log-title').textContent;
         const lines = document.getElementById('log-lines').innerText;
         return title.includes(arguments[0]) && title.includes('running') && lines.includes('building ' + arguments[1]);",
        vec![json!(instance), json!(second_web)],
    )
    .await;
    screenshot(&client, &shots, "page-running.png").await;

    // Let it finish: succeeded, and the record moved to the new ref.
    farm.store.pause.armed.store(false, Ordering::SeqCst);
    drop(gate);
    let events = converge.await.unwrap();
    assert!(succeeded(&events), "{events:#?}");
    wait_for(&client, "the converge succeeded", ROW_IS, vec![json!(instance), json!("succeeded")]).await;
    let new_ref = vec![json!(instance), json!(2), json!(second_web)];
    wait_for(&client, "generation 2 with the new ref", RECORD_SHOWS, new_ref.clone()).await;
    let still_old = run(
        &client,
        "return [...document.querySelectorAll('.record')].find(r => r.dataset.instance === arguments[0])
           .innerText.includes(arguments[1])",
        vec![json!(instance), json!(first_web)],
    )
    .await;
    assert_eq!(still_old, json!(false), "the record still names {first_web}");
    let log_ends = "return document.getElementById('log-lines').innerText.includes('succeeded')";
    wait_for(&client, "the log's end", log_ends, vec![]).await;

    // The byte ledger lists the instance's images on the agent's store; a dry-run gc shows up
    // among the recent sweeps.
    let in_ledger = "return document.getElementById('ledger').innerText.includes(arguments[0])";
    wait_for(&client, "the instance in the byte ledger", in_ledger, vec![json!(instance)]).await;
    let events = gc(&farm.url, true, None).await;
    assert!(succeeded(&events), "{events:#?}");
    let swept = "const sweeps = document.getElementById('sweeps').innerText;
         return sweeps.includes('gc --dry-run') && sweeps.includes('succeeded');";
    wait_for(&client, "the dry-run gc among the sweeps", swept, vec![]).await;
    // The whole page in one picture: a window as tall as the page (a screenshot is the viewport).
    let height = run(&client, "return document.documentElement.scrollHeight", vec![]).await;
    client.set_window_size(1280, height.as_u64().unwrap_or(1000).clamp(1000, 4000) as u32 + 150).await.unwrap();
    screenshot(&client, &shots, "page-wide.png").await;

    // A phone: the page reflows into cards and never scrolls sideways.
    client.set_window_size(390, 844).await.unwrap();
    client.goto(&page).await.unwrap();
    wait_for(&client, "the page on a phone", RECORD_SHOWS, new_ref).await;
    let fits =
        run(&client, "return { scroll: document.documentElement.scrollWidth, inner: window.innerWidth };", vec![])
            .await;
    let (scroll, inner) = (fits["scroll"].as_u64().unwrap(), fits["inner"].as_u64().unwrap());
    assert!(inner <= 400, "the window is phone-sized: {fits}");
    assert!(scroll <= inner, "the page scrolls sideways on a phone: {fits}");
    screenshot(&client, &shots, "page-phone.png").await;
    let height = run(&client, "return document.documentElement.scrollHeight", vec![]).await;
    client.set_window_size(390, height.as_u64().unwrap_or(844).clamp(844, 6000) as u32 + 150).await.unwrap();
    screenshot(&client, &shots, "page-phone-whole.png").await;

    client.close().await.unwrap();
    drop(driver);
    farm.stop().await;
    remove_built(&dir);
    // The first converge's web image: swept by the second already, unless something held it.
    kiln_e2e::docker::remove(&first_web);
}
