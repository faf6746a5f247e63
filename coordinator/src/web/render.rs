//! The status page as HTML, rendered here from [`Status`] and nowhere else: the page's script
//! swaps in the sections of a fresh render rather than building markup of its own, so the one
//! place that escapes is [`esc`]. Every string from the state — instance and image names, refs,
//! users, agent ids, event text — goes through it; a name like `<script>` reads as text.
//!
//! Tables carry a `data-label` per cell so that on a narrow screen the stylesheet can show each
//! row as a card of `label: value` lines instead of a table wider than the phone.

use std::fmt::Write;

use super::log::{Line, Log};
use super::view::{Agent, ConvergeRow, Instance, LedgerView, Status, Sweep, LEDGER_FRESH};

const PAGE: &str = include_str!("page.html");
const LOGIN: &str = include_str!("login.html");
/// Where a render goes into a template.
const BODY: &str = "<!--body-->";
/// The most log lines a page render carries; the rest is a `kiln logs` away.
const LOG_LINES: usize = 500;

/// `text` safe as HTML text and as a quoted attribute value.
pub(crate) fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Bytes in decimal units with one decimal, as `kiln` and `docker images` show them: `2.1 GB`.
pub(crate) fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "kB", "MB", "GB", "TB", "PB"];
    if n < 1000 {
        return format!("{n} B");
    }
    let (mut value, mut unit) = (n as f64, 0);
    while value >= 999.95 && unit < UNITS.len() - 1 {
        value /= 1000.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// `2026-12-01 09:18:08Z`.
fn utc(ms: u64) -> String {
    match time::OffsetDateTime::from_unix_timestamp((ms / 1000) as i64) {
        Ok(t) => format!(
            "{}-{:02}-{:02} {:02}:{:02}:{:02}Z",
            t.year(),
            t.month() as u8,
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        ),
        Err(_) => ms.to_string(),
    }
}

/// How long ago, short enough for a phone: `4 s ago`, `3 min ago`, `2 h ago`, `5 d ago`.
fn ago(now: u64, at: u64) -> String {
    let secs = now.saturating_sub(at) / 1000;
    match secs {
        0..=59 => format!("{secs} s ago"),
        60..=3599 => format!("{} min ago", secs / 60),
        3600..=86_399 => format!("{} h ago", secs / 3600),
        _ => format!("{} d ago", secs / 86_400),
    }
}

/// A time as a person reads it, with the exact UTC time on hover.
fn when(now: u64, at: u64) -> String {
    let exact = utc(at);
    format!(r#"<time datetime="{exact}" title="{exact}">{}</time>"#, ago(now, at))
}

fn took(ms: u64) -> String {
    match ms / 1000 {
        0..=59 => format!("{:.1} s", ms as f64 / 1000.0),
        s => format!("{} min {} s", s / 60, s % 60),
    }
}

/// One table cell, labeled for the phone layout; `html` is already escaped.
fn td(out: &mut String, label: &str, html: &str) {
    let _ = write!(out, r#"<td data-label="{label}">{html}</td>"#);
}

fn head(out: &mut String, columns: &[&str]) {
    out.push_str(r#"<table class="cards"><thead><tr>"#);
    for c in columns {
        let _ = write!(out, "<th>{c}</th>");
    }
    out.push_str("</tr></thead><tbody>");
}

/// Which converge log a render carries.
#[derive(Debug, Clone, Copy)]
pub(crate) enum LogPart<'a> {
    /// The live refresh: no log section, so the reader's log is left alone.
    Omit,
    /// The log of this converge (an empty section when there is none yet), and whether the
    /// reader picked it rather than the page following the newest converge.
    Show(Option<&'a Log>, bool),
}

/// The whole page, with the converge log below the converges.
pub(crate) fn page(status: &Status, log: LogPart<'_>) -> String {
    let mut body = String::new();
    header(&mut body, status);
    body.push_str("<main>");
    agents(&mut body, status);
    converges(&mut body, status);
    if let LogPart::Show(log, picked) = log {
        log_section(&mut body, status.now_ms, log, picked);
    }
    records(&mut body, status);
    ledger(&mut body, status.now_ms, &status.ledger);
    sweeps(&mut body, status);
    body.push_str("</main>");
    fill(PAGE, &body)
}

/// The login form, with why the last try failed.
pub(crate) fn login(error: Option<&str>) -> String {
    let body = match error {
        Some(error) => format!(r#"<p class="error" role="alert">{}</p>"#, esc(error)),
        None => String::new(),
    };
    fill(LOGIN, &body)
}

/// The template with `body` at its marker; the template's own text is never searched again, so
/// nothing in `body` can act as a marker.
fn fill(template: &str, body: &str) -> String {
    let (before, after) = template.split_once(BODY).expect("the template has its body marker");
    [before, body, after].concat()
}

fn header(out: &mut String, s: &Status) {
    let _ = write!(
        out,
        r#"<header id="top" data-live><h1>Kiln</h1><span>farm <b>{farm}</b></span><span class="muted">coordinator {version}</span><span class="muted">{viewer}</span><span class="muted">updated <time datetime="{now}">{now}</time></span>"#,
        farm = esc(&s.farm),
        version = esc(s.version),
        viewer = esc(&s.viewer),
        now = utc(s.now_ms),
    );
    if s.viewer.starts_with("user:") {
        out.push_str(r#"<form method="post" action="/logout"><button type="submit">Log out</button></form>"#);
    }
    match s.standby.as_deref() {
        None => {}
        Some("") => out.push_str(r#"<p class="error">This coordinator stands by and no coordinator holds the farm's lease yet; one takes over within seconds.</p>"#),
        Some(active) => {
            let _ = write!(out, r#"<p class="error">This coordinator stands by: the farm's active coordinator is at {}.</p>"#, esc(active));
        }
    }
    out.push_str("</header>");
}

fn agents(out: &mut String, s: &Status) {
    let connected = s.agents.iter().filter(|a| a.connected).count();
    let _ = write!(
        out,
        r#"<section id="agents" data-live><h2>Agents <span class="muted">{connected} connected · build slots {busy}/{slots} busy</span></h2>"#,
        busy = s.busy,
        slots = s.slots,
    );
    if s.agents.is_empty() {
        out.push_str(r#"<p class="muted">No agent has connected yet: start <code>kiln-agent</code> against this coordinator.</p></section>"#);
        return;
    }
    head(out, &["agent", "role", "platforms", "stores", "slots", "last seen", "state"]);
    for a in &s.agents {
        agent_row(out, s.now_ms, a);
    }
    out.push_str("</tbody></table></section>");
}

fn agent_row(out: &mut String, now: u64, a: &Agent) {
    out.push_str("<tr>");
    td(out, "agent", &format!("<b>{}</b>", esc(&a.id)));
    td(out, "role", &esc(&a.role));
    td(out, "platforms", &esc(&a.platforms.join(", ")));
    td(out, "stores", &format!(r#"<span class="ref">{}</span>"#, esc(&a.stores.join(", "))));
    let slots = match (a.connected, a.slots) {
        (false, _) | (true, 0) => "—".to_string(),
        (true, n) => format!("{}/{n} busy", a.busy),
    };
    td(out, "slots", &slots);
    td(out, "last seen", &when(now, a.last_seen_ms));
    let state = match (a.connected, a.draining) {
        (true, false) => r#"<span class="state succeeded">connected</span>"#,
        (true, true) => r#"<span class="state running">draining</span>"#,
        (false, _) => "gone",
    };
    td(out, "state", state);
    out.push_str("</tr>");
}

fn converges(out: &mut String, s: &Status) {
    let running = s.converges.iter().filter(|c| c.state == "running").count();
    let queued: usize = s.converges.iter().map(|c| c.tasks.iter().filter(|t| t.state == "queued").count()).sum();
    let follow = s.follow.as_deref().map(esc).unwrap_or_default();
    let _ = write!(
        out,
        r#"<section id="converges" data-live data-follow="{follow}"><h2>Converges <span class="muted">{running} running · {queued} build(s) queued</span></h2>"#
    );
    if s.converges.is_empty() {
        out.push_str(r#"<p class="muted">No converge yet: <code>kiln up</code> starts one.</p></section>"#);
        return;
    }
    head(out, &["converge", "instance", "state", "by", "started", "took", "builds"]);
    for c in &s.converges {
        converge_row(out, s.now_ms, c);
    }
    out.push_str("</tbody></table></section>");
}

fn converge_row(out: &mut String, now: u64, c: &ConvergeRow) {
    let id = esc(&c.id);
    let _ = write!(out, r#"<tr data-row="{id}">"#);
    td(out, "converge", &format!(r#"<a class="ref" href="/?converge={id}" data-converge="{id}">{id}</a>"#));
    td(out, "instance", &format!("<b>{}</b>", esc(&c.instance)));
    let mut state = format!(r#"<span class="state {0}">{0}</span>"#, c.state);
    if !c.reason.is_empty() {
        let _ = write!(state, r#" <span class="muted">{}</span>"#, esc(&c.reason));
    }
    td(out, "state", &state);
    td(out, "by", &esc(&c.requested_by));
    td(out, "started", &when(now, c.started_ms));
    let took_ms = c.finished_ms.unwrap_or(now).saturating_sub(c.started_ms);
    td(out, "took", &took(took_ms));
    let mut tasks = String::new();
    for t in &c.tasks {
        let what = match t.state {
            "queued" => format!("queued #{}", t.position),
            state => format!("{state} on {}", esc(&t.agent)),
        };
        let _ = write!(tasks, r#"<div><b>{}</b> {what} · {}</div>"#, esc(&t.image), took(t.for_ms));
    }
    td(out, "builds", if tasks.is_empty() { "—" } else { &tasks });
    out.push_str("</tr>");
}

fn log_section(out: &mut String, now: u64, log: Option<&Log>, picked: bool) {
    let Some(log) = log else {
        out.push_str(r#"<section id="log" data-converge="" data-after="0" data-state="" data-picked="0"><h2>Log <span id="log-title" class="muted">no converge yet</span></h2><ol id="log-lines"></ol></section>"#);
        return;
    };
    let after = log.events.last().map_or(0, |l| l.seq);
    let _ = write!(
        out,
        r#"<section id="log" data-converge="{id}" data-after="{after}" data-state="{state}" data-picked="{picked}"><h2>Log <span id="log-title" class="muted">{id} · {instance} · {state}</span></h2><ol id="log-lines">"#,
        id = esc(&log.converge),
        instance = esc(&log.instance),
        state = log.state,
        picked = u8::from(picked),
    );
    let skip = log.events.len().saturating_sub(LOG_LINES);
    if skip > 0 {
        let _ = write!(
            out,
            r#"<li class="muted">… {skip} earlier line(s): <code>kiln logs {}</code></li>"#,
            esc(&log.converge)
        );
    }
    for line in &log.events[skip..] {
        log_line(out, now, line);
    }
    out.push_str("</ol></section>");
}

/// One log line; the page's script builds the same shape from the JSON for lines that arrive.
fn log_line(out: &mut String, _now: u64, line: &Line) {
    let at = utc(line.at_ms);
    let clock = at.get(11..19).unwrap_or(&at);
    let image = line.image.as_deref().map(|i| format!("<b>{}</b> ", esc(i))).unwrap_or_default();
    let _ = write!(
        out,
        r#"<li class="k-{kind}"><span class="muted">{clock}</span> {image}{text}</li>"#,
        kind = esc(&line.kind),
        text = esc(&line.text)
    );
}

fn records(out: &mut String, s: &Status) {
    let _ = write!(
        out,
        r#"<section id="records" data-live><h2>Records <span class="muted">{} instance(s)</span></h2>"#,
        s.instances.len()
    );
    if s.instances.is_empty() {
        out.push_str(r#"<p class="muted">No instance has converged yet.</p></section>"#);
        return;
    }
    for i in &s.instances {
        record(out, s.now_ms, i);
    }
    out.push_str("</section>");
}

fn record(out: &mut String, now: u64, i: &Instance) {
    let by = i.written_by.as_deref().map(|b| format!(" by {}", esc(b))).unwrap_or_default();
    let owner = i.owner.as_deref().map(|o| format!(" · owner {}", esc(o))).unwrap_or_default();
    let _ = write!(
        out,
        r#"<div class="record" data-instance="{name}"><h3>{name} <span class="muted">generation {generation}</span></h3><p class="muted">written {when}{by}{owner}</p>"#,
        name = esc(&i.instance),
        generation = i.generation,
        when = when(now, i.written_at_ms),
    );
    head(out, &["image", "ref", "USER", "target"]);
    for image in &i.images {
        out.push_str("<tr>");
        let kind = if image.kind == "built" {
            String::new()
        } else {
            format!(r#" <span class="muted">{}</span>"#, image.kind)
        };
        td(out, "image", &format!("<b>{}</b>{kind}", esc(&image.name)));
        td(out, "ref", &format!(r#"<span class="ref">{}</span>"#, esc(&image.reference)));
        let user = match (&image.user, image.kind) {
            (Some(user), _) => esc(user),
            (None, "built") => {
                r#"<span class="muted" title="the image declares no USER: it runs as root">(root)</span>"#.to_string()
            }
            // Kiln never inspects what it did not build.
            (None, _) => {
                r#"<span class="muted" title="not inspected: Kiln never inspects brought or pinned images">—</span>"#
                    .to_string()
            }
        };
        td(out, "USER", &user);
        td(out, "target", &esc(&image.target));
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table></div>");
}

fn ledger(out: &mut String, now: u64, view: &LedgerView) {
    out.push_str(r#"<section id="ledger" data-live><h2>Bytes <span class="muted">per owner per store, and what <code>kiln gc</code> would free now</span></h2>"#);
    let mut fresh = match view.listed_ms {
        Some(at) => format!("Listed {} (the sweep's dry-run plan", when(now, at)),
        None => "Not listed yet (the sweep's dry-run plan".to_string(),
    };
    let _ = write!(
        fresh,
        ", made at most every {} s while this page is open, and soon after a converge ends)",
        LEDGER_FRESH.as_secs()
    );
    if view.refreshing {
        fresh.push_str(" · listing the stores now…");
    }
    let _ = write!(out, r#"<p class="muted">{fresh}</p>"#);
    if let Some(error) = &view.error {
        let _ = write!(out, r#"<p class="error">The last listing failed: {}</p>"#, esc(error));
    }
    let Some(ledger) = &view.ledger else {
        out.push_str("</section>");
        return;
    };
    head(out, &["store", "owner", "images", "bytes", "gc would free"]);
    for store in &ledger.stores {
        let name = format!(r#"<span class="ref">{}</span>"#, esc(&store.store));
        if let Some(why) = &store.not_swept {
            let _ = write!(out, "<tr>");
            td(out, "store", &name);
            td(out, "owner", &format!(r#"<span class="error">not swept: {}</span>"#, esc(why)));
            out.push_str("</tr>");
            continue;
        }
        if store.owners.is_empty() {
            out.push_str("<tr>");
            td(out, "store", &name);
            td(out, "owner", r#"<span class="muted">none of this farm's images</span>"#);
            out.push_str("</tr>");
        }
        for owner in &store.owners {
            out.push_str("<tr>");
            td(out, "store", &name);
            td(out, "owner", &format!("<b>{}</b>", esc(&owner.owner)));
            td(out, "images", &owner.images.to_string());
            td(out, "bytes", &bytes(owner.bytes));
            td(out, "gc would free", &bytes(owner.would_free));
            out.push_str("</tr>");
        }
    }
    let c = &ledger.contexts;
    out.push_str("<tr>");
    td(out, "store", "uploaded contexts (coordinator)");
    td(out, "owner", r#"<span class="muted">—</span>"#);
    td(out, "images", &format!("{} context(s)", c.contexts));
    td(out, "bytes", &bytes(c.bytes));
    td(out, "gc would free", &format!("{} ({} context(s))", bytes(c.would_collect_bytes), c.would_collect));
    out.push_str("</tr></tbody></table>");
    let removals: u64 = ledger.stores.iter().map(|s| s.removals).sum();
    let _ = write!(
        out,
        r#"<p><b>gc would free {}</b> <span class="muted">({removals} removal(s); owners sharing a layer each count it, so owners can add up to more than a store holds)</span></p></section>"#,
        bytes(ledger.would_free),
    );
}

fn sweeps(out: &mut String, s: &Status) {
    out.push_str(r#"<section id="sweeps" data-live><h2>Recent sweeps <span class="muted"><code>kiln gc</code> runs; each converge's own sweep is in its log</span></h2>"#);
    if s.sweeps.is_empty() {
        out.push_str(r#"<p class="muted">No <code>kiln gc</code> has run.</p></section>"#);
        return;
    }
    head(out, &["gc", "job", "state", "by", "started", "result"]);
    for sweep in &s.sweeps {
        sweep_row(out, s.now_ms, sweep);
    }
    out.push_str("</tbody></table></section>");
}

fn sweep_row(out: &mut String, now: u64, w: &Sweep) {
    let id = esc(&w.id);
    out.push_str("<tr>");
    td(out, "gc", &format!(r#"<a class="ref" href="/?converge={id}" data-converge="{id}">{id}</a>"#));
    td(out, "job", &format!("<code>{}</code>", esc(&w.job)));
    let mut state = format!(r#"<span class="state {0}">{0}</span>"#, w.state);
    if !w.reason.is_empty() {
        let _ = write!(state, r#" <span class="muted">{}</span>"#, esc(&w.reason));
    }
    td(out, "state", &state);
    td(out, "by", &esc(&w.requested_by));
    td(out, "started", &when(now, w.started_ms));
    let verb = if w.job.contains("--dry-run") { "would free" } else { "freed" };
    let mut result = format!("{verb} {} image(s), {} · {} removal(s)", w.images, bytes(w.bytes), w.removals);
    if w.failures > 0 {
        let _ = write!(result, r#" · <span class="error">{} failed</span>"#, w.failures);
    }
    td(out, "result", &result);
    out.push_str("</tr>");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::web::view::Image;

    fn status() -> Status {
        Status {
            farm: "f".into(),
            version: "0.1.0",
            now_ms: 10_000,
            viewer: "open".into(),
            standby: None,
            agents: Vec::new(),
            slots: 0,
            busy: 0,
            converges: Vec::new(),
            follow: None,
            instances: Vec::new(),
            ledger: LedgerView::default(),
            sweeps: Vec::new(),
        }
    }

    #[test]
    fn markup_in_names_refs_and_users_is_shown_as_text() {
        let mut s = status();
        s.instances.push(Instance {
            instance: "<script>alert(1)</script>".into(),
            generation: 1,
            written_at_ms: 0,
            written_by: Some("\"><img src=x onerror=alert(2)>".into()),
            owner: None,
            images: vec![Image {
                name: "<b>web</b>".into(),
                reference: "r:1'onmouseover='x".into(),
                kind: "built",
                user: Some("<i>app</i>".into()),
                target: "local".into(),
            }],
        });
        let html = page(&s, LogPart::Omit);
        // The page's own script follows `main`; everything from the state is inside it.
        let body = html.split_once("<main>").unwrap().1.split_once("</main>").unwrap().0;
        assert!(
            !body.contains("<script>") && !body.contains("<img") && !body.contains("<b>web") && !body.contains("<i>")
        );
        assert!(body.contains("&lt;script&gt;alert(1)&lt;/script&gt;"), "{body}");
        assert!(body.contains("r:1&#39;onmouseover=&#39;x"));
        assert!(body.contains("&quot;&gt;&lt;img src=x onerror=alert(2)&gt;"));
    }

    #[test]
    fn a_log_line_is_text_whatever_the_build_printed() {
        let log = Log {
            converge: "c1".into(),
            instance: "shop".into(),
            state: "running",
            events: vec![Line {
                seq: 1,
                at_ms: 0,
                image: Some("web".into()),
                kind: "build_log".into(),
                text: "| <script>fetch('/x')</script>".into(),
            }],
            more: false,
        };
        let html = page(&status(), LogPart::Show(Some(&log), false));
        assert!(html.contains("| &lt;script&gt;fetch(&#39;/x&#39;)&lt;/script&gt;"), "{html}");
        assert!(html.contains(r#"data-after="1""#));
    }

    #[test]
    fn a_template_marker_inside_a_name_stays_text() {
        let mut s = status();
        s.farm = BODY.to_string();
        assert_eq!(page(&s, LogPart::Omit).matches(BODY).count(), 0, "the marker was escaped, not filled");
    }

    #[test]
    fn a_standby_says_where_the_active_coordinator_is() {
        let mut s = status();
        s.standby = Some("https://coord-b:7070".into());
        assert!(page(&s, LogPart::Omit).contains("the farm's active coordinator is at https://coord-b:7070"));
        s.standby = None;
        assert!(!page(&s, LogPart::Omit).contains("stands by"));
    }

    #[test]
    fn a_draining_agent_reads_as_draining_not_gone() {
        let agent = |id: &str, connected, draining| crate::web::view::Agent {
            id: id.into(),
            role: "host".into(),
            platforms: Vec::new(),
            stores: Vec::new(),
            slots: 1,
            busy: 1,
            version: "0.1.0".into(),
            last_seen_ms: 0,
            connected,
            draining,
        };
        let mut s = status();
        s.agents = vec![agent("leaving", true, true), agent("left", false, false)];
        let html = page(&s, LogPart::Omit);
        let row = |id: &str| html.split(&format!("<b>{id}</b>")).nth(1).unwrap().split("</tr>").next().unwrap();
        assert!(row("leaving").contains(">draining</span>"), "{html}");
        assert!(row("left").contains(">gone<"), "{html}");
    }

    #[test]
    fn sizes_and_ages_read_short() {
        assert_eq!(bytes(999), "999 B");
        assert_eq!(bytes(2_100_000_000), "2.1 GB");
        assert_eq!(ago(200_000, 80_000), "2 min ago");
        assert_eq!(utc(1_796_117_888_000), "2026-12-01 09:38:08Z");
    }
}
