"""Where the workers of a torchft run reach one another: a worker advertises this machine's
address on its route to the Lighthouse (torchft's ``socket.gethostname()`` and torchrun's
``MASTER_ADDR=localhost`` do not reach another node), and its heal server answers there."""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta
from urllib.parse import urlparse


def route_address(address: str) -> str:
    """This machine's address on its route to ``address`` (a URL such as the Lighthouse's, or
    host:port): where a machine that reaches ``address`` reaches this one. A UDP socket's
    ``connect`` picks the route and sends nothing."""
    parsed = urlparse(address if "//" in address else f"//{address}")
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    family, kind, proto, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(target)
        return probe.getsockname()[0]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) resolves to this machine's loopback only."""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (socket.gaierror, ValueError):
        return False


def advertised_addresses(lighthouse: str, store_addr: str) -> tuple:
    """(the host this rank's torchft Manager and heal server are reached at, the worker's store
    address the other workers' ranks are given) for a Lighthouse at ``lighthouse`` and this job's
    store at ``store_addr`` (``MASTER_ADDR``).

    torchft advertises ``socket.gethostname()``, and a job started by ``torchrun --standalone``
    has ``MASTER_ADDR=localhost``: on another node (or wherever the host name resolves to a
    loopback address, as in many containers) neither reaches this one. Both become this
    machine's address on its route to the Lighthouse, which every worker reaches; a job whose
    store is on another machine (a worker over several nodes) keeps ``MASTER_ADDR``."""
    host = route_address(lighthouse)
    return host, (host if is_loopback(store_addr) else store_addr)


def url_host(host: str) -> str:
    """``host`` as a URL writes it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


def heal_transport(host: str, timeout: timedelta):
    """torchft's HTTP checkpoint transport (what a healing peer fetches), at ``host`` instead of
    ``socket.gethostname()``, without an access line per request."""
    from torchft.checkpointing import HTTPTransport

    class HealTransport(HTTPTransport):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            # One line per heal is the worker's own (FaultTolerantSyncGroup): no HTTP access line
            # per request on stderr (this server's handler class only; http.server's is untouched).
            self._server.RequestHandlerClass.log_message = lambda handler, *args: None

        def address(self) -> str:
            return f"http://{url_host(host)}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return HealTransport(timeout=timeout, num_chunks=0)
