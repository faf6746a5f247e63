//! The embedded default: with no `--coordinator`, a command starts the real coordinator
//! (`kiln_coordinator::serve`) and a host agent (`kiln_agent::run`) in this process, runs against
//! them, and shuts both down before it returns.
//!
//! They are exactly the code a farm runs, started on `127.0.0.1:0`, with their state in
//! `$KILN_HOME` — one per user, shared by every instance converged from this account. A command
//! starts only once the agent is connected, because a converge that starts before any host store
//! is known would find nothing held and rebuild everything; and every wait is bounded, failing with
//! the part that did not come up.

use std::future::Future;
use std::time::Duration;

use kiln_agent::AgentConfig;
use kiln_coordinator::Config;
use kiln_proto::v1::kiln_client::KilnClient;
use kiln_proto::v1::AgentsRequest;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::connect::{self, Link};
use crate::error::CliError;
use crate::home::EmbeddedSite;
use crate::Connect;

/// How long the embedded agent has to connect.
pub const AGENT_WAIT: Duration = Duration::from_secs(10);

/// How long each embedded part has to stop once asked.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// The running embedded coordinator and agent.
#[derive(Debug)]
pub struct Embedded {
    pub site: EmbeddedSite,
    pub url: String,
    /// `None` once its end has been awaited (a part that stopped early is reported once).
    coordinator: Option<JoinHandle<Result<(), kiln_coordinator::ServeError>>>,
    agent: Option<JoinHandle<Result<(), kiln_agent::RunError>>>,
    stop_coordinator: oneshot::Sender<()>,
    stop_agent: Option<oneshot::Sender<()>>,
}

impl Embedded {
    /// Starts the coordinator on a fresh loopback port and, when `with_agent`, the host agent, and
    /// waits (at most [`AGENT_WAIT`]) until the coordinator answers — and lists the agent as
    /// connected, when there is one.
    pub async fn start(site: EmbeddedSite, with_agent: bool, window: Duration) -> Result<(Embedded, Link), CliError> {
        Embedded::start_with(site, with_agent, false, window).await
    }

    /// [`Embedded::start`], optionally as a read-only coordinator (no agent, no lock needed).
    async fn start_with(
        site: EmbeddedSite,
        with_agent: bool,
        read_only: bool,
        window: Duration,
    ) -> Result<(Embedded, Link), CliError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|err| CliError::Unreachable { at: site.describe(), reason: connect::reason(&err) })?;
        let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
        let url = format!("http://127.0.0.1:{port}");

        let (stop_coordinator, stopped) = oneshot::channel::<()>();
        let mut config = Config::new(site.state_dir(), site.farm.clone());
        config.read_only = read_only;
        let coordinator = tokio::spawn(kiln_coordinator::serve(listener, config, async move {
            let _ = stopped.await;
        }));
        let mut embedded = Embedded {
            site,
            url: url.clone(),
            coordinator: Some(coordinator),
            agent: None,
            stop_coordinator,
            stop_agent: None,
        };

        if with_agent {
            let (stop_agent, stopped) = oneshot::channel::<()>();
            let config = AgentConfig {
                // The coordinator stops with it, and the CLI stops them only once its converge
                // ended: nothing is left to drain, and waiting would slow every command's exit.
                drain_grace: std::time::Duration::ZERO,
                // It lives for one command and a start empties the cache, while the contexts it
                // would keep sit in the content store on this same disk: nothing to keep.
                context_cache: 0,
                ..AgentConfig::new(url.clone(), embedded.site.agent_id(), embedded.site.scratch_dir())
            };
            embedded.agent = Some(tokio::spawn(kiln_agent::run(config, async move {
                let _ = stopped.await;
            })));
            embedded.stop_agent = Some(stop_agent);
        }

        match embedded.until_ready(window).await {
            Ok(link) => Ok((embedded, link)),
            Err(err) => {
                // What the other part says while stopping is a consequence of `err`, not news.
                embedded.stop(false).await;
                Err(err)
            }
        }
    }

    async fn until_ready(&mut self, window: Duration) -> Result<Link, CliError> {
        let channel = tonic::service::interceptor::InterceptedService::new(
            connect::endpoint(&self.url)?.connect_lazy(),
            connect::Bearer::new(None)?,
        );
        let link = Link { url: self.url.clone(), at: self.site.describe(), channel, window, farm: false };
        let mut client = KilnClient::new(link.channel.clone());
        let agent_id = self.site.agent_id();
        let deadline = tokio::time::Instant::now() + AGENT_WAIT;
        // The in-process agent connects within a few milliseconds of starting, so the first ask
        // almost always comes too early: a fixed 100 ms pause then cost every embedded command
        // 100 ms (two thirds of a no-op `kiln up`). Start short and back off instead.
        let mut pause = Duration::from_millis(2);
        loop {
            self.check_alive().await?;
            if let Ok(reply) = client.agents(AgentsRequest {}).await {
                let ready = match self.agent {
                    None => true,
                    Some(_) => reply.into_inner().agents.iter().any(|a| a.connected && !a.draining && a.id == agent_id),
                };
                if ready {
                    return Ok(link);
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(match self.agent {
                    Some(_) => {
                        CliError::AgentTimeout { agent: agent_id, at: self.site.describe(), secs: AGENT_WAIT.as_secs() }
                    }
                    None => CliError::Unreachable {
                        at: self.site.describe(),
                        reason: format!("the embedded coordinator did not answer within {} s", AGENT_WAIT.as_secs()),
                    },
                });
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(100));
        }
    }

    /// Fails with the part that stopped, and why, if either has.
    async fn check_alive(&mut self) -> Result<(), CliError> {
        if let Some(coordinator) = self.coordinator.take_if(|c| c.is_finished()) {
            let state = self.site.state_dir();
            return Err(match coordinator.await {
                Ok(Err(err)) => CliError::CoordinatorDown { state, err: Box::new(err) },
                Ok(Ok(())) => CliError::CoordinatorStopped { state },
                Err(_) => CliError::EmbeddedPanicked { what: "coordinator" },
            });
        }
        if let Some(agent) = self.agent.take_if(|a| a.is_finished()) {
            let id = self.site.agent_id();
            let result = agent.await;
            return Err(match result {
                Ok(Err(err)) => CliError::AgentDown { agent: id, err: Box::new(err) },
                Ok(Ok(())) => CliError::AgentStopped { agent: id },
                Err(_) => CliError::EmbeddedPanicked { what: "agent" },
            });
        }
        Ok(())
    }

    /// Stops the agent, then the coordinator, waiting a bounded time for each. A part that fails
    /// to stop cleanly is reported on stderr; the command's own outcome stands.
    pub async fn shutdown(self) {
        self.stop(true).await;
    }

    async fn stop(self, report: bool) {
        if let Some(stop) = self.stop_agent {
            let _ = stop.send(());
        }
        if let Some(agent) = self.agent {
            let stopped = bounded(agent).await;
            if report {
                report_stop("agent", stopped);
            }
        }
        let _ = self.stop_coordinator.send(());
        if let Some(coordinator) = self.coordinator {
            let stopped = bounded(coordinator).await;
            if report {
                report_stop("coordinator", stopped);
            }
        }
    }
}

/// Waits at most [`STOP_WAIT`] for `task`, then aborts it: a part that ignores its shutdown must
/// not keep the command from exiting.
async fn bounded<T>(mut task: JoinHandle<T>) -> Result<Result<T, tokio::task::JoinError>, tokio::time::error::Elapsed> {
    let stopped = tokio::time::timeout(STOP_WAIT, &mut task).await;
    if stopped.is_err() {
        task.abort();
    }
    stopped
}

type Stopped<E> = Result<Result<Result<(), E>, tokio::task::JoinError>, tokio::time::error::Elapsed>;

fn report_stop<E: std::error::Error + 'static>(what: &str, result: Stopped<E>) {
    match result {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(err))) => {
            eprintln!("kiln: warning: the embedded {what} stopped with an error: {}", crate::error::report(&err))
        }
        Ok(Err(_)) => eprintln!("kiln: warning: the embedded {what} panicked while stopping"),
        Err(_) => eprintln!("kiln: warning: the embedded {what} did not stop within {} s", STOP_WAIT.as_secs()),
    }
}

/// Runs `command` against the coordinator `connect` names — or, with none, against an embedded
/// one started for it (with its host agent when `need_agent`) and shut down after.
pub async fn with_coordinator<T, F, Fut>(connect: &Connect, need_agent: bool, command: F) -> Result<T, CliError>
where
    F: FnOnce(Link) -> Fut,
    Fut: Future<Output = Result<T, CliError>>,
{
    match &connect.coordinator {
        Some(url) => command(connect::dial_with(url, connect.retry_window, &connect.credentials()?).await?).await,
        None => {
            let site = EmbeddedSite::prepare(connect.kiln_home.as_deref())?;
            let lock = lock_home(&site).await?;
            let (embedded, link) = Embedded::start(site, need_agent, connect.retry_window).await?;
            let result = command(link).await;
            embedded.shutdown().await;
            drop(lock);
            result
        }
    }
}

/// [`with_coordinator`], with `first` (the walk and addressing of `kiln up`) run while the
/// coordinator comes up rather than before: the embedded coordinator's and agent's start — or a
/// served coordinator's dial — and the walk each take tens of milliseconds of a no-op `kiln up`,
/// and neither needs the other. `command` gets what `first` made. A `first` that fails is the error
/// shown: a broken context is what the user must fix first. The embedded parts are let finish
/// starting and then stopped, so a failed walk leaves `$KILN_HOME` as a finished command does.
pub async fn with_coordinator_after<A, T, P, F, Fut>(
    connect: &Connect,
    need_agent: bool,
    first: P,
    command: F,
) -> Result<T, CliError>
where
    P: Future<Output = Result<A, CliError>>,
    F: FnOnce(Link, A) -> Fut,
    Fut: Future<Output = Result<T, CliError>>,
{
    match &connect.coordinator {
        Some(url) => {
            // The first failure ends both: a walk that fails does not wait out the dial's retries.
            let dial = async { connect::dial_with(url, connect.retry_window, &connect.credentials()?).await };
            let (made, link) = tokio::try_join!(first, dial)?;
            command(link, made).await
        }
        None => {
            let site = EmbeddedSite::prepare(connect.kiln_home.as_deref())?;
            let starting = async move {
                let lock = lock_home(&site).await?;
                let started = Embedded::start(site, need_agent, connect.retry_window).await?;
                Ok::<_, CliError>((lock, started))
            };
            match tokio::join!(first, starting) {
                (Ok(made), Ok((lock, (embedded, link)))) => {
                    let result = command(link, made).await;
                    embedded.shutdown().await;
                    drop(lock);
                    result
                }
                (Err(err), Ok((lock, (embedded, _)))) => {
                    embedded.shutdown().await;
                    drop(lock);
                    Err(err)
                }
                (Err(err), Err(_)) | (Ok(_), Err(err)) => Err(err),
            }
        }
    }
}

/// Runs a read (`status`, `logs`, `pins`) against the coordinator `connect` names, or an embedded
/// one. Reads need no lock: while another `kiln` holds `$KILN_HOME` (a long `kiln up`), a
/// read-only coordinator serves the state beside it instead of waiting for it to finish.
pub async fn with_reader<T, F, Fut>(connect: &Connect, command: F) -> Result<T, CliError>
where
    F: FnOnce(Link) -> Fut,
    Fut: Future<Output = Result<T, CliError>>,
{
    let Some(site) =
        connect.coordinator.is_none().then(|| EmbeddedSite::prepare(connect.kiln_home.as_deref())).transpose()?
    else {
        return with_coordinator(connect, false, command).await;
    };
    match try_lock_home(&site)? {
        Some(lock) => {
            let (embedded, link) = Embedded::start(site, false, connect.retry_window).await?;
            let result = command(link).await;
            embedded.shutdown().await;
            drop(lock);
            result
        }
        None => {
            let (embedded, link) = Embedded::start_with(site, false, true, connect.retry_window).await?;
            let result = command(link).await;
            embedded.shutdown().await;
            result
        }
    }
}

/// `$KILN_HOME`'s lock if no other `kiln` holds it, else `None`.
fn try_lock_home(site: &EmbeddedSite) -> Result<Option<std::fs::File>, CliError> {
    let path = site.home.join("embedded.lock");
    let home_err = |err| CliError::Home { path: path.clone(), err };
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(home_err)?;
    match file.try_lock() {
        Ok(()) => {
            let _ = std::fs::write(&path, format!("pid {}", std::process::id()));
            Ok(Some(file))
        }
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(err)) => Err(home_err(err)),
    }
}

/// Takes `$KILN_HOME`'s lock for the embedded coordinator's lifetime, waiting for another `kiln`
/// that holds it. One coordinator per state at a time: a second one starting beside a running
/// converge would mark that converge failed as if its coordinator had died.
async fn lock_home(site: &EmbeddedSite) -> Result<std::fs::File, CliError> {
    let path = site.home.join("embedded.lock");
    let home_err = |err| CliError::Home { path: path.clone(), err };
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(home_err)?;
    let file = match file.try_lock() {
        Ok(()) => file,
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            eprintln!(
                "kiln: another kiln ({}) is using KILN_HOME {}; waiting for it to finish",
                holder.trim(),
                site.home.display()
            );
            tokio::task::spawn_blocking(move || file.lock().map(|()| file))
                .await
                .map_err(|_| CliError::EmbeddedPanicked { what: "home lock" })?
                .map_err(home_err)?
        }
        Err(std::fs::TryLockError::Error(err)) => return Err(home_err(err)),
    };
    let _ = std::fs::write(&path, format!("pid {}", std::process::id()));
    Ok(file)
}
