//! `kiln-bench trust`: what trust costs (issue 8). A no-op `kiln up` — the whole library call the
//! binary makes — against a served coordinator speaking TLS with a bearer token on every call and
//! an enrolled agent on mutual TLS, against the same converge on a plaintext coordinator (`--dev`,
//! no authentication); and a context upload over TLS against the same upload in plaintext. Both
//! coordinators run in this process on loopback, each with a host agent over the real Docker daemon.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kiln::{Connect, OutputMode, UpArgs};
use kiln_coordinator::trust::Role;
use kiln_core::archive::pack;
use kiln_core::digest::{walk_tree, WalkOptions};
use kiln_e2e::trust::TrustedFarm;

use crate::converge::{write_context, write_manifest, Coordinator};
use crate::util::{self, Contestant};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Measured runs per contestant (the median is reported).
    #[arg(long, default_value_t = 15)]
    runs: usize,
    /// Size of the uploaded context in MiB.
    #[arg(long, default_value_t = 256)]
    upload_mib: u64,
}

const NOOP_GOAL_MS: f64 = 10.0;
const UPLOAD_GOAL: f64 = 0.8;

pub fn run(args: &Args) -> Result<()> {
    let scratch = util::scratch_dir("kiln-bench-trust-")?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let dir = scratch.path().join("instance");
    let names = vec!["a".to_string(), "b".to_string()];
    for (i, name) in names.iter().enumerate() {
        write_context(&dir.join(name), 200, 4096, 0x7475 + i as u64)?;
    }
    write_manifest(&dir, &format!("trust{:08x}", fastrand::u32(..)), &names)?;

    // The trusted farm: TLS, an enrolled agent on mutual TLS, a member's token in a 0600 file.
    let mut tls = rt.block_on(TrustedFarm::start(&scratch.path().join("tls-state")));
    let agent_dir = scratch.path().join("agent");
    rt.block_on(tls.enroll("bench-host", kiln_coordinator::model::AgentRole::Host, "", &agent_dir));
    let stop_tls_agent =
        start_agent(&rt, &tls.url, "bench-host", &agent_dir, Some(kiln_agent::enroll::Identity::in_dir(&agent_dir)));
    let token = rt.block_on(tls.token("bench", Role::Member, None, None));
    let token_file = scratch.path().join("token");
    std::fs::write(&token_file, &token)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600))?;
    let ca_file = tls.state.join("tls/ca.pem");
    let trusted =
        Connect { ca: Some(ca_file.clone()), token_file: Some(token_file.clone()), ..Connect::remote(tls.url.clone()) };

    // The plaintext farm, as `--dev` serves.
    let plain = rt.block_on(Coordinator::start(&scratch.path().join("plain-state"), "bench-plain", false))?;
    let stop_plain_agent = start_agent(&rt, &plain.url, "bench-plain", &scratch.path().join("plain-agent"), None);

    let up = |connect: &Connect| -> Result<Duration> {
        let args = UpArgs {
            dir: dir.clone(),
            force: false,
            dry_run: false,
            connect: connect.clone(),
            output: OutputMode::Quiet,
        };
        let started = Instant::now();
        let outcome = rt.block_on(kiln::up(args))?;
        let took = started.elapsed();
        if outcome.outcome != kiln::Outcome::Succeeded {
            bail!("the converge failed: {:?}", outcome.failure);
        }
        Ok(took)
    };
    let plain_connect = Connect::remote(plain.url.clone());
    // Warm both: the first converge builds; the measured ones are no-ops.
    up(&trusted).context("the first converge against the TLS coordinator")?;
    up(&plain_connect).context("the first converge against the plaintext coordinator")?;
    let mut contestants = vec![
        Contestant::new("no-op kiln up, TLS + token (mutual-TLS agent)", || up(&trusted)),
        Contestant::new("no-op kiln up, plaintext --dev", || up(&plain_connect)),
    ];
    util::rounds(&mut contestants, args.runs, 1, || Ok(()))?;
    let added_ms = (contestants[0].median().as_secs_f64() - contestants[1].median().as_secs_f64()) * 1e3;

    // Uploads: a fresh context digest per run, so every run really uploads to both.
    let ctx = scratch.path().join("upload");
    crate::upload::generate(&ctx, 16, (args.upload_mib << 20) / 16)?;
    let run = std::cell::Cell::new(0u64);
    let upload = |url: &str, ca: Option<&Path>, token: Option<&str>| -> Result<Duration> {
        run.set(run.get() + 1);
        std::fs::write(ctx.join("nonce"), run.get().to_le_bytes())?;
        let tree = walk_tree(&ctx, &WalkOptions::default())?;
        let digest = pack(&tree, std::io::sink())?.digest;
        let source = kiln::request::ContextSource {
            dir: ctx.clone(),
            walk: WalkOptions::default(),
            images: vec!["u".into()],
            archive_bytes: 0,
            tree: None,
            stat_cache: None,
        };
        let credentials = kiln::connect::Credentials {
            ca_pem: ca.map(std::fs::read_to_string).transpose()?,
            token: token.map(str::to_string),
        };
        rt.block_on(async {
            let link = kiln::connect::dial_with(url, Duration::from_secs(10), &credentials).await?;
            let client = kiln_proto::v1::content_store_client::ContentStoreClient::new(link.channel);
            let started = Instant::now();
            kiln::upload::upload(client, digest.to_string(), source, None).await?;
            Ok(started.elapsed())
        })
    };
    let mut uploads = vec![
        Contestant::new("upload over TLS + token", || upload(&tls.url, Some(&ca_file), Some(&token))),
        Contestant::new("upload in plaintext", || upload(&plain.url, None, None)),
    ];
    util::rounds(&mut uploads, args.runs.min(5), 1, || Ok(()))?;
    let bytes = walk_tree(&ctx, &WalkOptions::default())?.entries.iter().map(|e| e.size).sum::<u64>() as f64;
    let (tls_gbs, plain_gbs) =
        (bytes / uploads[0].median().as_secs_f64() / 1e9, bytes / uploads[1].median().as_secs_f64() / 1e9);

    println!("## The cost of trust\n");
    println!("2 built images × 200 files × 4 KiB, target `local`; {} runs each, medians; both coordinators in-process on loopback.", args.runs);
    util::print_table("No-op `kiln up`: TLS + token vs plaintext", &contestants);
    println!("\n- added by TLS + token at the median: {added_ms:.1} ms (goal ≤ {NOOP_GOAL_MS} ms)");
    util::print_table(&format!("Upload of {} MiB", args.upload_mib), &uploads);
    println!(
        "\n- TLS {tls_gbs:.2} GB/s vs plaintext {plain_gbs:.2} GB/s: {:.2}× (goal ≥ {UPLOAD_GOAL})",
        tls_gbs / plain_gbs
    );

    drop(uploads);
    drop(contestants);
    let _ = stop_tls_agent.send(());
    let _ = stop_plain_agent.send(());
    rt.block_on(tls.stop());
    rt.block_on(plain.stop())?;
    Ok(())
}

fn start_agent(
    rt: &tokio::runtime::Runtime,
    url: &str,
    id: &str,
    dir: &Path,
    identity: Option<kiln_agent::enroll::Identity>,
) -> tokio::sync::oneshot::Sender<()> {
    let config = kiln_agent::AgentConfig {
        identity,
        // An enrolled agent is the id its certificate names.
        ..kiln_agent::AgentConfig::new(url.to_string(), id.to_string(), dir.join("scratch"))
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    rt.spawn(async move {
        let _ = kiln_agent::run(config, async {
            let _ = stopped.await;
        })
        .await;
    });
    stop
}
