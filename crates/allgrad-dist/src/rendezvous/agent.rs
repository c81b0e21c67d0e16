//! The rendezvous through torchrun's agent store.
//!
//! torchrun's agent already serves a PyTorch TCPStore at MASTER_ADDR:MASTER_PORT and says so
//! with `TORCHELASTIC_USE_AGENT_STORE=True` ([`Elastic::agent_store`](crate::Elastic::agent_store)), so rank 0 cannot bind
//! that port. Instead rank 0 starts allgrad's own (authenticated) store on a free port of the
//! MASTER_ADDR interface and publishes its address in the agent's store under the restart
//! round's prefix (`/worker/attempt_<restart count>`, the prefix PyTorch's env:// rendezvous
//! used for agent stores); every other rank reads it there. From then on the job proceeds as
//! without torchrun: every rank connects to allgrad's store and the authenticated mesh is
//! built.

use std::net::{SocketAddr, ToSocketAddrs};

use crate::error::{DistError, DistResult};
use crate::rendezvous::elastic::STORE_ADDR_KEY;
use crate::rendezvous::env::WorldInfo;
use crate::rendezvous::store::StoreServer;
use crate::rendezvous::torch_store::TorchStore;

/// When torchrun's agent serves the store, rendezvous through it: rank 0 starts allgrad's
/// store on a free port and publishes the address; the returned world info points every rank
/// at that store. `None` when there is no agent store (or a world of one rank).
pub(crate) fn rendezvous_via_agent(info: &WorldInfo) -> DistResult<Option<(WorldInfo, Option<StoreServer>)>> {
    let Some(elastic) = info.elastic.as_ref().filter(|e| e.agent_store && info.world_size > 1) else {
        return Ok(None);
    };
    let agent_addr = format!("{}:{}", info.master_addr, info.master_port);
    let agent = TorchStore::connect(&agent_addr, info.timeout)?.with_prefix(&elastic.round_prefix());
    let (addr, server) = if info.rank == 0 {
        let ip = (info.master_addr.as_str(), 0)
            .to_socket_addrs()
            .map_err(|e| DistError::io(format!("resolving MASTER_ADDR {}", info.master_addr), e))?
            .next()
            .ok_or_else(|| DistError::Env(format!("MASTER_ADDR {} resolves to no address", info.master_addr)))?;
        let server = StoreServer::start(ip, &info.token)?;
        let addr = server.addr();
        agent.set(STORE_ADDR_KEY, addr.to_string().as_bytes())?;
        (addr, Some(server))
    } else {
        let raw = agent.get(STORE_ADDR_KEY)?;
        let text = String::from_utf8_lossy(&raw);
        let addr: SocketAddr = text.parse().map_err(|_| {
            DistError::Store(format!(
                "{:?} in torchrun's TCPStore at {agent_addr} is not an address: {text:?}",
                agent.wire_key(STORE_ADDR_KEY)
            ))
        })?;
        (addr, None)
    };
    tracing::debug!("rank {}: torchrun's agent store at {agent_addr} points at allgrad's store {addr}", info.rank);
    let mut joined = info.clone();
    joined.master_addr = addr.ip().to_string();
    joined.master_port = addr.port();
    Ok(Some((joined, server)))
}
