//! A scripted stand-in for the coordinator's `AgentHub`, on a free loopback port: it welcomes one
//! agent, records its hello, sends the tasks a test hands it and returns their results. The real
//! coordinator does not yet send tasks to node agents; this is the wire contract it will use.

use kiln_proto::v1 as pb;
use std::sync::Mutex;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

#[derive(Debug)]
pub struct StandIn {
    pub url: String,
    hellos: mpsc::Receiver<pb::Hello>,
    tasks: mpsc::Sender<pb::Task>,
    results: mpsc::Receiver<pb::TaskResult>,
    next: u64,
}

struct Service {
    hellos: mpsc::Sender<pb::Hello>,
    tasks: Mutex<Option<mpsc::Receiver<pb::Task>>>,
    results: mpsc::Sender<pb::TaskResult>,
}

impl StandIn {
    pub async fn start() -> StandIn {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (hellos_tx, hellos) = mpsc::channel(4);
        let (tasks, tasks_rx) = mpsc::channel(16);
        let (results_tx, results) = mpsc::channel(16);
        let service = Service { hellos: hellos_tx, tasks: Mutex::new(Some(tasks_rx)), results: results_tx };
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(pb::agent_hub_server::AgentHubServer::new(service))
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        StandIn { url, hellos, tasks, results, next: 0 }
    }

    pub async fn hello(&mut self) -> pb::Hello {
        self.hellos.recv().await.expect("the agent connected and said hello")
    }

    /// Sends one task and waits for its outcome.
    pub async fn run(&mut self, kind: pb::task::Kind) -> pb::task_result::Outcome {
        self.next += 1;
        let task_id = format!("t{}", self.next);
        let task = pb::Task {
            task_id: task_id.clone(),
            converge_id: "c1".to_string(),
            kind: Some(kind),
            ..Default::default()
        };
        self.tasks.send(task).await.unwrap();
        let result = self.results.recv().await.expect("the agent answered");
        assert_eq!(result.task_id, task_id);
        result.outcome.expect("an answer carries an outcome")
    }
}

#[tonic::async_trait]
impl pb::agent_hub_server::AgentHub for Service {
    type ConnectStream = ReceiverStream<Result<pb::CoordinatorMessage, Status>>;

    async fn connect(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let welcome =
            pb::Welcome { coordinator_version: "stand-in".into(), heartbeat_ms: 60_000, refused: String::new() };
        let _ =
            tx.send(Ok(pb::CoordinatorMessage { body: Some(pb::coordinator_message::Body::Welcome(welcome)) })).await;
        let (hellos, results) = (self.hellos.clone(), self.results.clone());
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                match message.body {
                    Some(pb::agent_message::Body::Hello(hello)) => {
                        let _ = hellos.send(hello).await;
                    }
                    Some(pb::agent_message::Body::Result(result)) => {
                        let _ = results.send(result).await;
                    }
                    _ => {}
                }
            }
        });
        if let Some(mut tasks) = self.tasks.lock().unwrap().take() {
            tokio::spawn(async move {
                while let Some(task) = tasks.recv().await {
                    let message = pb::CoordinatorMessage { body: Some(pb::coordinator_message::Body::Task(task)) };
                    if tx.send(Ok(message)).await.is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
