"""torchrun, with the stores its agents host listening where they were told to, not on every interface.

``python -m distrain.distributed.agent [torchrun's arguments] script ...`` is torchrun (``torch.distributed.run``),
restarts and elastic rendezvous included. torch's TCPStore listens on every interface whatever host it is given, and
it answers whoever connects (it has no authentication): anyone on the machine's networks could read a job's
addresses or write false ones. torchrun's agents host two: the rendezvous store (c10d: on the node the endpoint
names; static: on node 0, at the master address) and the store the ranks share (opened by the agent of node 0 at the
address torchrun advertises for it, ``--local-addr``). This process opens each listening socket itself, on the
address that store was given when it is this machine's (``process_group._narrow_listener``, the rule distrain's own
store follows), and hands it to torch: the rendezvous store through a multi-tenant server started first on its port
(torch shares a multi-tenant server by port: torchrun's rendezvous takes the one running), the ranks' store through
the agent's own factory. ``--standalone`` (one node) becomes a static rendezvous on 127.0.0.1."""

from __future__ import annotations

import sys
from datetime import timedelta

#: the listening sockets handed to torch's stores: kept open for the life of the process
_LISTENERS: list = []


def main(argv: list[str]) -> None:
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    args = run.parse_args(argv)
    argv = [a for a in argv if a not in ("--standalone", "--standalone=true")] if args.standalone else argv
    if args.standalone:  # one node: the rendezvous on loopback, at a port this process holds
        listener = _listen("127.0.0.1", 0)
        host, port = "127.0.0.1", listener.getsockname()[1]
        argv = ["--nnodes=1", "--node-rank=0", f"--master-addr={host}", f"--master-port={port}", *argv]
        _serve(listener, host, port)
    elif args.rdzv_backend == "static" and args.node_rank == 0:
        _serve(_listen(args.master_addr, args.master_port), args.master_addr, args.master_port)
    elif args.rdzv_backend == "c10d" and args.rdzv_endpoint:
        host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
        _serve(_listen(host, port), host, port)  # the node the endpoint names hosts it; elsewhere, nothing to bind
    _ranks_store_listens_narrowly()
    run.main(argv)


def _listen(host: str, port: int):
    from distrain.distributed.process_group import _narrow_listener

    try:
        return _narrow_listener(host, port)
    except OSError:  # the port is taken: torch says so in its own words
        return None


def _serve(listener, host: str, port: int) -> None:
    """A multi-tenant store server on ``listener`` (None: leave it to torch), before torchrun asks for one on
    ``port``."""
    import torch.distributed as dist

    if listener is None:
        return
    store = dist.TCPStore(
        host, port, None, is_master=True, multi_tenant=True, master_listen_fd=listener.fileno(),
        timeout=timedelta(minutes=5),
    )  # fmt: skip
    _LISTENERS.append((listener, store))  # torch keeps only a weak reference to a shared server


def _ranks_store_listens_narrowly() -> None:
    """The store node 0's agent opens for the ranks (``DynamicRendezvousHandler._create_tcp_store_server``, called
    with the address torchrun advertises for the node and port 0), on a socket bound to that address."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    made_by_torch = DynamicRendezvousHandler._create_tcp_store_server

    def create(self, master_addr, master_port):
        listener = _listen(master_addr, master_port)
        if listener is None:
            return made_by_torch(self, master_addr, master_port)
        port = listener.getsockname()[1]
        store = dist.TCPStore(
            host_name=master_addr, port=port, is_master=True, multi_tenant=True, master_listen_fd=listener.fileno()
        )
        _LISTENERS.append((listener, store))
        return store

    DynamicRendezvousHandler._create_tcp_store_server = create


if __name__ == "__main__":
    main(sys.argv[1:])
