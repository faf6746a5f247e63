//! The coordinator's listening sockets, with an accept queue sized for a farm.
//!
//! `TcpListener::bind` asks the kernel for a queue of 128 pending connections. A farm reaches
//! that at once: a thousand agents reconnecting after a failover, or a few hundred CLIs starting
//! converges together, outrun the accept loop for a moment, and every connection past the queue
//! has its SYN dropped and sent again by its client a whole second later (then 3 s, then 7 s).
//! Measured with `kiln-bench farm` before this (`nstat`): over 1,000 listen overflows and about
//! 840 SYN retransmits a round, and in some rounds the converges arrived over 1 s instead of 0.1 s.

use std::net::SocketAddr;
use tokio::net::{TcpListener, TcpSocket};

/// Pending connections the kernel may hold for the accept loop; Linux caps it at
/// `net.core.somaxconn` (4096 by default since 5.4).
pub const BACKLOG: u32 = 4096;

/// Listens on the first address `addr` resolves to, with [`BACKLOG`] pending connections.
pub async fn listen(addr: &str) -> std::io::Result<TcpListener> {
    let mut resolved = tokio::net::lookup_host(addr).await?;
    let first = resolved.next().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::AddrNotAvailable, format!("{addr} resolves to no address"))
    })?;
    listen_on(first)
}

/// Listens on `addr` with [`BACKLOG`] pending connections.
pub fn listen_on(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    // As `TcpListener::bind` does: a restarted coordinator binds its port again at once.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The queue asked for is the one the kernel keeps: `ss` shows it as the listener's Send-Q,
    /// and /proc/net/tcp has no column for it, so it is read back by filling it. With nothing
    /// accepting, more than 128 connections complete their handshake — `TcpListener::bind`'s
    /// queue would drop the SYNs past 129 and leave their connects waiting a second.
    #[tokio::test]
    async fn more_than_128_connections_wait_in_the_queue_while_nothing_accepts() {
        let listener = listen("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut connected = Vec::new();
        for _ in 0..300 {
            let connect = tokio::net::TcpStream::connect(addr);
            let stream = tokio::time::timeout(std::time::Duration::from_millis(500), connect)
                .await
                .expect("a connect past the queue would wait for its SYN to be sent again")
                .unwrap();
            connected.push(stream);
        }
        assert_eq!(connected.len(), 300);
        drop(listener);
    }
}
