"""torchrun, with the stores its agents host listening where they were told to, not on every interface.

``python -m distrain.distributed.agent [torchrun's arguments] script ...`` is torchrun (``torch.distributed.run``),
restarts and elastic rendezvous included. torch's TCPStore listens on every interface whatever host it is given, and
it answers whoever connects (it has no authentication): anyone on the machine's networks could read a job's
addresses or write false ones. torchrun's agents host two: the rendezvous store (c10d: on the node the endpoint
names; static: on node 0, at the master address) and the store the ranks share (opened by the agent of node 0 at the
address torchrun advertises for it, ``--local-addr``). This process opens each listening socket itself, on the
address that store was given when it is this machine's (``process_group.narrow_listener``, the rule distrain's own
store follows), and hands it to torch: the rendezvous store through a multi-tenant server started first on its port
(torch shares a multi-tenant server by port: torchrun's rendezvous takes the one running), the ranks' store through
the agent's own factory. ``--standalone`` (one node) becomes a static rendezvous on 127.0.0.1."""

from __future__ import annotations

import socket
import sys
from datetime import timedelta

#: the listening sockets handed to torch's stores: kept open for the life of the process
_LISTENERS: list = []


def main(argv: list[str]) -> None:
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    args = run.parse_args(argv)
    if args.standalone:  # one node: the rendezvous on loopback, at a port this process holds
        script = argv.index(args.training_script)  # torchrun's own options come before it, the script's after
        argv = [a for a in argv[:script] if a != "--standalone"] + argv[script:]
        listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        host, port = "127.0.0.1", listener.getsockname()[1]
        argv = ["--nnodes=1", "--node-rank=0", f"--master-addr={host}", f"--master-port={port}", *argv]
        _serve(listener, host)
    elif args.rdzv_backend == "static" and args.node_rank == 0:
        _serve(_listen(args.master_addr, args.master_port), args.master_addr)
    elif args.rdzv_backend == "c10d" and args.rdzv_endpoint:
        host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
        _serve(_listen(host, port), host)  # the node the endpoint names hosts it; elsewhere, nothing to bind
    _ranks_store_listens_narrowly()
    run.main(argv)


def _listen(host: str, port: int):
    from distrain.distributed.process_group import narrow_listener

    try:
        return narrow_listener(host, port)
    except OSError:  # the port is taken: torch says so in its own words
        return None


def _serve(listener, host: str):
    """A multi-tenant store server on ``listener``, at its port (None: leave it to torch): torchrun's own request for
    a server on that port then takes this one."""
    import torch.distributed as dist

    if listener is None:
        return None
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        host, port, None, is_master=True, multi_tenant=True, master_listen_fd=listener.fileno(),
        timeout=timedelta(minutes=5),
    )  # fmt: skip
    _LISTENERS.append((listener, store))  # torch keeps only a weak reference to a shared server
    return store


def _ranks_store_listens_narrowly() -> None:
    """The store node 0's agent opens for the ranks (``DynamicRendezvousHandler._create_tcp_store_server``, called
    with the address torchrun advertises for the node and port 0), on a socket bound to that address."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    made_by_torch = DynamicRendezvousHandler._create_tcp_store_server

    def create(self, master_addr, master_port):
        return _serve(_listen(master_addr, master_port), master_addr) or made_by_torch(self, master_addr, master_port)

    DynamicRendezvousHandler._create_tcp_store_server = create


if __name__ == "__main__":
    main(sys.argv[1:])
