//! Picking a loopback port for a server that starts later.

use std::io;
use std::net::{Ipv4Addr, TcpListener, TcpStream};

/// A loopback port nobody listens on, kept out of the kernel's hands until
/// a server binds it: for a process or replica that must know its port
/// before it starts (a broker binary, a replica restarted on its address).
///
/// Binding port 0 and closing the socket would leave the port free for the
/// next `bind(0)` or outgoing connection of anyone on the machine, which
/// under a parallel test run does happen. Instead the port is left holding
/// a connection in TIME_WAIT: Linux hands out neither a listening port nor
/// an outgoing one that a socket still occupies, while an explicit bind
/// with `SO_REUSEADDR` (which the standard library, tokio and tonic set)
/// succeeds. The hold ends by itself after the TIME_WAIT interval (60 s).
pub fn reserve_loopback_port() -> io::Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let addr = listener.local_addr()?;
    let client = TcpStream::connect(addr)?;
    let (accepted, _) = listener.accept()?;
    // The side that closes first keeps TIME_WAIT: the listener's side, so
    // the state sits on `addr.port()`.
    drop(accepted);
    drop(client);
    Ok(addr.port())
}
