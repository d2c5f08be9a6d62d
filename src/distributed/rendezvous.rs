//! The rendezvous: rank 0 hands a few bytes (NCCL's unique id) to every other rank over TCP on
//! the launcher's master address, as PyTorch's TCPStore does for `ProcessGroupNCCL`.
//!
//! Rank 0 listens on the port on every interface; the others connect (retrying while rank 0
//! is not up yet) and send a 32-byte hello: a magic number, the protocol version, the world
//! size, their rank and a key of the job. Once every rank has said hello, rank 0 answers each
//! with the payload. A hello that is malformed, of another job or world size, of a rank out of
//! range or already present is answered with the reason and closed; rank 0 keeps waiting for
//! the right peers. Every wait is bounded: a rank that never comes is named in the error.

use crate::{Error, Result};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"MNTSRDZV";
const VERSION: u32 = 1;
const HELLO: usize = 32;
/// The largest payload accepted: a reply claiming more is not ours.
const MAX_PAYLOAD: usize = 1 << 16;
/// How long rank 0 waits for a connected peer's hello before dropping it.
const HELLO_WAIT: Duration = Duration::from_secs(2);

/// Who takes part: the address rank 0 listens on and this rank's place.
#[derive(Debug, Clone)]
pub(crate) struct Meeting {
    pub addr: String,
    pub port: u16,
    pub rank: usize,
    pub world_size: usize,
    /// A key of the job (a hash of its id): a rank of another job is refused.
    pub job: u64,
    pub timeout: Duration,
}

impl Meeting {
    fn err(&self, msg: impl Into<String>) -> Error {
        Error::Distributed {
            op: "rendezvous",
            rank: self.rank,
            world_size: self.world_size,
            msg: msg.into(),
        }
    }

    fn hello(&self) -> [u8; HELLO] {
        let mut h = [0u8; HELLO];
        h[..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&(self.world_size as u32).to_le_bytes());
        h[16..20].copy_from_slice(&(self.rank as u32).to_le_bytes());
        h[24..32].copy_from_slice(&self.job.to_le_bytes());
        h
    }

    /// The peer rank a hello announces, or why it is refused.
    fn check_hello(
        &self,
        h: &[u8; HELLO],
        present: &[Option<TcpStream>],
    ) -> std::result::Result<usize, String> {
        let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        if &h[..8] != MAGIC {
            return Err("not a mantissa rendezvous hello".into());
        }
        if word(8) != VERSION {
            return Err(format!("protocol version {} (this is {VERSION})", word(8)));
        }
        if word(12) as usize != self.world_size {
            return Err(format!(
                "a peer of world size {} (this job has {})",
                word(12),
                self.world_size
            ));
        }
        let job = u64::from_le_bytes(h[24..32].try_into().expect("8 bytes"));
        if job != self.job {
            return Err("a peer of another job".into());
        }
        let rank = word(16) as usize;
        if rank == 0 || rank >= self.world_size {
            return Err(format!(
                "rank {rank} is not a peer rank of {}",
                self.world_size
            ));
        }
        if present[rank].is_some() {
            return Err(format!("rank {rank} has already joined"));
        }
        Ok(rank)
    }
}

/// Rank 0: waits for every other rank, then gives them `payload` (made once the port is
/// held). Other ranks: the payload rank 0 gives.
pub(crate) fn share(m: &Meeting, payload: impl FnOnce() -> Result<Vec<u8>>) -> Result<Vec<u8>> {
    let deadline = Instant::now() + m.timeout;
    if m.world_size <= 1 {
        return payload();
    }
    match m.rank {
        0 => host(m, deadline, payload),
        _ => join(m, deadline),
    }
}

fn host(
    m: &Meeting,
    deadline: Instant,
    payload: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    let any: SocketAddr = match m.addr.contains(':') {
        true => (std::net::Ipv6Addr::UNSPECIFIED, m.port).into(),
        false => (std::net::Ipv4Addr::UNSPECIFIED, m.port).into(),
    };
    let listener = TcpListener::bind(any)
        .map_err(|e| m.err(format!("rank 0 cannot listen on port {}: {e}", m.port)))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| m.err(format!("listening on port {}: {e}", m.port)))?;
    let payload = payload()?;
    if payload.len() > MAX_PAYLOAD {
        return Err(m.err(format!("a payload of {} bytes", payload.len())));
    }
    let mut peers: Vec<Option<TcpStream>> = (0..m.world_size).map(|_| None).collect();
    while peers.iter().skip(1).any(Option::is_none) {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = (1..m.world_size).filter(|&r| peers[r].is_none()).collect();
            return Err(m.err(format!(
                "ranks {missing:?} of {} did not join on port {} within {:?}",
                m.world_size, m.port, m.timeout
            )));
        }
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(m.err(format!("accepting on port {}: {e}", m.port))),
        };
        let mut stream = stream;
        let wait = HELLO_WAIT
            .min(deadline.saturating_duration_since(now))
            .max(Duration::from_millis(1));
        let mut h = [0u8; HELLO];
        let read = stream
            .set_nonblocking(false)
            .and_then(|_| stream.set_read_timeout(Some(wait)))
            .and_then(|_| stream.read_exact(&mut h));
        if read.is_err() {
            continue; // silent or short: not a peer; dropped
        }
        match m.check_hello(&h, &peers) {
            Ok(rank) => peers[rank] = Some(stream),
            Err(why) => {
                log::warn!("rendezvous on port {}: refused a connection: {why}", m.port);
                let _ = reply(&mut stream, 1, why.as_bytes());
            }
        }
    }
    for (rank, peer) in peers.iter_mut().enumerate().skip(1) {
        let s = peer.as_mut().expect("every peer joined");
        reply(s, 0, &payload).map_err(|e| m.err(format!("sending the id to rank {rank}: {e}")))?;
    }
    Ok(payload)
}

fn reply(s: &mut TcpStream, status: u8, bytes: &[u8]) -> std::io::Result<()> {
    let mut msg = vec![status];
    msg.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    msg.extend_from_slice(bytes);
    s.set_write_timeout(Some(HELLO_WAIT))?;
    s.write_all(&msg)
}

fn join(m: &Meeting, deadline: Instant) -> Result<Vec<u8>> {
    let addrs: Vec<SocketAddr> = (m.addr.as_str(), m.port)
        .to_socket_addrs()
        .map_err(|e| m.err(format!("cannot resolve MASTER_ADDR {:?}: {e}", m.addr)))?
        .collect();
    let mut last = String::from("no address");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(m.err(format!(
                "rank 0 did not answer at {}:{} within {:?} (last: {last})",
                m.addr, m.port, m.timeout
            )));
        }
        for a in &addrs {
            let stream = TcpStream::connect_timeout(a, left.min(Duration::from_secs(1)));
            let mut s = match stream {
                Ok(s) => s,
                Err(e) => {
                    last = e.to_string();
                    continue;
                }
            };
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            let sent = s
                .set_write_timeout(Some(left))
                .and_then(|_| s.write_all(&m.hello()))
                .and_then(|_| s.set_read_timeout(Some(left)));
            if let Err(e) = sent {
                last = e.to_string();
                continue;
            }
            let mut head = [0u8; 5];
            match s.read_exact(&mut head) {
                Ok(()) => {}
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    return Err(m.err(format!(
                        "rank 0 at {}:{} did not hand out the id within {:?}: some rank did not join",
                        m.addr, m.port, m.timeout
                    )))
                }
                Err(e) => {
                    last = format!("the connection closed: {e}");
                    continue;
                }
            }
            let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
            if head[0] > 1 || len > MAX_PAYLOAD {
                return Err(m.err(format!(
                    "{}:{} answered with something that is not a mantissa rendezvous",
                    m.addr, m.port
                )));
            }
            let mut body = vec![0u8; len];
            s.read_exact(&mut body)
                .map_err(|e| m.err(format!("reading the id from rank 0: {e}")))?;
            if head[0] == 1 {
                return Err(m.err(format!(
                    "rank 0 refused this rank: {}",
                    String::from_utf8_lossy(&body)
                )));
            }
            return Ok(body);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A 64-bit key of a job id string (FNV-1a), for the hello.
pub(crate) fn job_key(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn meeting(port: u16, rank: usize, world_size: usize, secs: u64) -> Meeting {
        Meeting {
            addr: "127.0.0.1".into(),
            port,
            rank,
            world_size,
            job: job_key("test"),
            timeout: Duration::from_secs(secs),
        }
    }

    #[test]
    fn every_rank_gets_rank_zeros_payload() {
        let port = free_port();
        let peers: Vec<_> = (1..4)
            .map(|r| std::thread::spawn(move || share(&meeting(port, r, 4, 20), || unreachable!())))
            .collect();
        // Rank 0 comes last: the others retry until it listens.
        std::thread::sleep(Duration::from_millis(200));
        let id: Vec<u8> = (0..128u8).collect();
        let got = share(&meeting(port, 0, 4, 20), || Ok(id.clone())).unwrap();
        assert_eq!(got, id);
        for p in peers {
            assert_eq!(p.join().unwrap().unwrap(), id);
        }
    }

    #[test]
    fn foreign_and_malformed_peers_are_refused_and_the_wait_goes_on() {
        let port = free_port();
        let host = std::thread::spawn(move || share(&meeting(port, 0, 2, 20), || Ok(vec![7; 128])));
        std::thread::sleep(Duration::from_millis(200));
        // Garbage, then a short write that closes: both dropped.
        let mut junk = TcpStream::connect(("127.0.0.1", port)).unwrap();
        junk.write_all(&[0xAB; 40]).unwrap();
        let mut head = [0u8; 5];
        junk.read_exact(&mut head).unwrap();
        assert_eq!(head[0], 1, "refused with a reason");
        drop(TcpStream::connect(("127.0.0.1", port)).unwrap());
        // Another job's rank 1, and a rank out of range: refused by name.
        let mut other = meeting(port, 1, 2, 5);
        other.job = job_key("another job");
        let e = share(&other, || unreachable!()).unwrap_err().to_string();
        assert!(e.contains("another job"), "{e}");
        let e = share(&meeting(port, 1, 3, 5), || unreachable!())
            .unwrap_err()
            .to_string();
        assert!(e.contains("world size 3"), "{e}");
        // The right rank 1 still gets the id.
        assert_eq!(
            share(&meeting(port, 1, 2, 20), || unreachable!()).unwrap(),
            vec![7; 128]
        );
        assert_eq!(host.join().unwrap().unwrap(), vec![7; 128]);
    }

    #[test]
    fn a_missing_rank_is_named_within_the_timeout() {
        let port = free_port();
        let t = Instant::now();
        let peer = std::thread::spawn(move || share(&meeting(port, 1, 3, 2), || unreachable!()));
        let e = share(&meeting(port, 0, 3, 1), || Ok(vec![1]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("ranks [2] of 3 did not join"), "{e}");
        assert!(peer.join().unwrap().is_err());
        // Rank 0 never coming: the peer's own deadline.
        let e = share(&meeting(free_port(), 1, 2, 1), || unreachable!())
            .unwrap_err()
            .to_string();
        assert!(e.contains("did not answer"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10));
    }
}
