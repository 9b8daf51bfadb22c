"""A replica group's live state, served to a peer group that rejoins (``ddp_torchft``): torchft's HTTP checkpoint
transport, made safe on both sides.

- Reading is weights-only: torchft's own receiving side unpickles a peer's answer with ``weights_only=False``, so
  whatever answers on the address the quorum names could run code in this process. The state distrain sends
  (``CheckpointManager.live_state``) is tensors and plain containers, as a checkpoint.
- Serving asks every request for the job's secret (``Authorization: Bearer <secret>``; anything else is a 403 on
  every path and method) and, with ``loopback``, listens on 127.0.0.1 only: torchft's server listens on every
  interface and hands weights, optimizer and data position to any GET. The secret never goes into the address
  torchft passes on through its manager and lighthouse, which serve it without authentication.
"""

from __future__ import annotations

import hmac
import pickle
import secrets
import socket
import threading
import urllib.error
import urllib.request
import warnings
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from torchft.checkpointing import HTTPTransport
from torchft.checkpointing._rwlock import RWLock
from torchft.checkpointing._serialization import _streaming_load, _streaming_save
from torchft.http import _IPv6HTTPServer

from distrain.checkpoint.safe_load import refused
from distrain.cluster import JOB_SECRET

#: the secret of peers in this process only (``peer_state_transport`` with none given)
_OWN_SECRET = secrets.token_urlsafe(32)
#: a peer is reached directly: through an http_proxy of the environment the proxy would see the secret and state
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def peer_state_transport(timeout: timedelta, secret: str | None = None, loopback: bool = True) -> SafeHTTPTransport:
    """The transport a ``ddp_torchft`` replica group serves its live state with and reads a peer's from (see the
    module's docstring). ``secret`` None: one of this process's own (peers in this process only)."""
    return SafeHTTPTransport(timeout, secret or _OWN_SECRET, loopback)


class SafeHTTPTransport(HTTPTransport):
    def __init__(self, timeout: timedelta, secret: str, loopback: bool) -> None:
        # Not torchft's __init__: it starts a server on every interface, without a secret, before a subclass could
        # change it. These are the fields torchft 0.2's send_checkpoint, allow_checkpoint, disallow_checkpoint,
        # recv_checkpoint and shutdown use.
        self._checkpoint_lock = RWLock(timeout=timeout.total_seconds())
        self._disallowed, self._step, self._timeout, self._num_chunks = False, -1, timeout, 0
        self._state_dict = self._spec = self._chunks = None
        device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        self._stream = torch.Stream(device) if device is not None else None
        self.authorization, self.loopback = f"Bearer {secret}".encode(), loopback
        self.disallow_checkpoint()  # nothing is served before the manager's first send_checkpoint
        if loopback:
            self._server = ThreadingHTTPServer(("127.0.0.1", 0), _PeerStateHandler)
        else:  # groups on several machines: every interface, as torchft's
            self._server = _IPv6HTTPServer(("", 0), _PeerStateHandler)
        self._server.transport = self
        self._thread = threading.Thread(target=self._server.serve_forever, name="peer state", daemon=True)
        self._thread.start()

    def address(self) -> str:  # what torchft passes on to the peers (through its manager): never the secret
        host = "127.0.0.1" if self.loopback else socket.gethostname()
        return f"http://{host}:{self._server.server_address[1]}/checkpoint/"

    def _load_from_address(self, address: str, timeout: timedelta) -> object:  # torchft 0.2's read of a peer's bytes
        request = urllib.request.Request(address, headers={"Authorization": self.authorization.decode()})
        try:
            response = _OPENER.open(request, timeout=timeout.total_seconds())
        except urllib.error.HTTPError as e:
            if e.code != 403:
                raise
            raise RuntimeError(
                f"the peer state at {address} was refused (HTTP 403): that replica group holds another "
                f"{JOB_SECRET}; every group of a job needs the same"
            ) from None
        with response, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")  # copied on load
            try:
                return _streaming_load(response, weights_only=True)
            except pickle.UnpicklingError as e:
                raise refused(f"the peer state at {address}", e) from None


class _PeerStateHandler(BaseHTTPRequestHandler):
    """Every request of a ``SafeHTTPTransport``'s server (``self.server.transport``)."""

    def setup(self) -> None:
        self.transport: SafeHTTPTransport = self.server.transport
        self.timeout = self.transport._timeout.total_seconds()  # a stalled client does not hold a thread forever
        super().setup()

    def parse_request(self) -> bool:  # every request, whatever its method and path
        if not super().parse_request():
            return False
        given = self.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, self.transport.authorization):
            self.send_error(403, "this job's secret is missing or wrong")
            return False
        return True

    def do_GET(self) -> None:
        transport = self.transport
        parts = self.path.split("/")  # /checkpoint/<step>/full: num_chunks=0
        if len(parts) != 4 or parts[1] != "checkpoint" or parts[3] != "full":
            self.send_error(404, "expected /checkpoint/<step>/full")
            return
        lock = transport._checkpoint_lock
        try:
            lock.r_acquire()  # waits while the manager allows no state out
        except TimeoutError:
            self.send_error(503, "no state to serve within the timeout")
            return
        try:
            if parts[2] != str(transport._step):
                self.send_error(400, f"serving step {transport._step}, not {parts[2]}")
                return
            self.send_response(200)
            self.send_header("Content-type", "application/octet-stream")
            self.end_headers()
            _streaming_save(transport._state_dict, self.wfile)
        except OSError:
            pass  # the peer went away or stalled (its own timeout): nobody to answer
        finally:
            lock.r_release()

    def log_message(self, *args) -> None:  # one stderr line per request
        pass
