//! The converges running now, so `kiln cancel` can stop one and `kiln ps` can show them.

use std::collections::BTreeMap;
use std::sync::Mutex;
use tokio::sync::watch;

/// One running converge: who asked, and the switch that cancels it.
#[derive(Debug)]
pub struct Entry {
    pub instance: String,
    pub owner: String,
    pub requested_by: String,
    pub started_ms: u64,
    /// Set once to why it was cancelled.
    cancel: watch::Sender<Option<String>>,
}

#[derive(Debug, Default)]
pub struct Running {
    converges: Mutex<BTreeMap<String, Entry>>,
}

/// A converge's membership, removed when dropped; `cancelled` resolves with the reason.
#[derive(Debug)]
pub struct Ticket<'a> {
    running: &'a Running,
    id: String,
    rx: watch::Receiver<Option<String>>,
}

impl Ticket<'_> {
    /// Resolves when the converge is cancelled, with why.
    pub async fn cancelled(&mut self) -> String {
        loop {
            if let Some(why) = self.rx.borrow_and_update().clone() {
                return why;
            }
            if self.rx.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.running.converges.lock().unwrap().remove(&self.id);
    }
}

impl Running {
    pub fn enter(&self, id: &str, instance: &str, owner: &str, requested_by: &str) -> Ticket<'_> {
        let (cancel, rx) = watch::channel(None);
        let entry = Entry {
            instance: instance.to_string(),
            owner: owner.to_string(),
            requested_by: requested_by.to_string(),
            started_ms: super::now_ms(),
            cancel,
        };
        self.converges.lock().unwrap().insert(id.to_string(), entry);
        Ticket { running: self, id: id.to_string(), rx }
    }

    /// The instance of a running converge.
    pub fn instance_of(&self, id: &str) -> Option<String> {
        self.converges.lock().unwrap().get(id).map(|e| e.instance.clone())
    }

    /// Cancels the converge `id`; false when it is not running here.
    pub fn cancel(&self, id: &str, why: String) -> bool {
        match self.converges.lock().unwrap().get(id) {
            Some(entry) => {
                entry.cancel.send_replace(Some(why));
                true
            }
            None => false,
        }
    }

    /// Every running converge: id, instance, owner, requested by, started.
    pub fn list(&self) -> Vec<(String, String, String, String, u64)> {
        let converges = self.converges.lock().unwrap();
        converges
            .iter()
            .map(|(id, e)| (id.clone(), e.instance.clone(), e.owner.clone(), e.requested_by.clone(), e.started_ms))
            .collect()
    }
}
