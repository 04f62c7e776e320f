"""A TLS cluster's HTTP servers ask for the cluster's certificates too (issue 22).

Dask starts an HTTP server in every scheduler and worker (the dashboard, ``/metrics``,
``/health`` and the data service's ``/dataservice/status.json``), even with
``--no-dashboard``, and it serves plain HTTP on every interface unless
``distributed.scheduler.dashboard.tls.*`` is set; when it is, Dask's context does not ask for
a client certificate. So on a cluster whose comms use TLS, a process without a certificate
could still read job counts, worker addresses and metrics. :func:`secure_http` closes that:
on a process whose comm address is ``tls://``,

- an HTTP server with a TLS context of Dask's (``dashboard.tls.*``) asks for a client
  certificate signed by the cluster's CA (``verify_mode = CERT_REQUIRED``);
- a plain HTTP server is started again on the same addresses and ports with the process's own
  TLS context (``Security.get_listen_args``: its certificate, the cluster's CA, client
  certificates required), so it serves only processes that hold a certificate of the CA.

Processes on ``tcp://`` are left alone (their HTTP is as open as their comms), and so is
every process with ``dataservice.dashboard.mutual-tls: false`` (a platform whose proxy reads
the dashboard over plain HTTP, such as Dask Gateway's).
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

__all__ = ["secure_http"]

logger = logging.getLogger(__name__)


def secure_http(server: Any, role: str) -> str:
    """Make ``server``'s HTTP server mutual TLS if its comms are TLS; say what was done
    (``"not tls"``, ``"no http"``, ``"required client certificates"``, ``"restarted with tls"``)."""
    from .. import config

    if not str(getattr(server, "address", "") or "").startswith("tls://"):
        return "not tls"
    if not config.get("dashboard.mutual-tls"):
        return "off"
    http = getattr(server, "http_server", None)
    if http is None:
        return "no http"
    security = server.security
    current = getattr(http, "ssl_options", None)
    if isinstance(current, ssl.SSLContext):
        if current.verify_mode != ssl.CERT_REQUIRED:
            if security.tls_ca_file:
                current.load_verify_locations(cafile=security.tls_ca_file)
            current.verify_mode = ssl.CERT_REQUIRED
        return "required client certificates"
    context = security.get_listen_args(role).get("ssl_context")
    if context is None:  # a tls:// address without a context: nothing to serve TLS with
        logger.warning("dataservice: %s %s serves plain HTTP on a TLS cluster and has no TLS "
                       "context to serve it with", role, server.address)
        return "plain"
    from tornado.httpserver import HTTPServer

    addresses = [sock.getsockname()[:2] for sock in http._sockets.values()]
    http.stop()
    new = HTTPServer(server.http_application, ssl_options=context)
    for host, port in addresses:
        new.listen(port, host)
    # Dask reads the server's address and port off these attributes (``ServerNode``)
    new.address, new.port = getattr(http, "address", None), getattr(http, "port", None)  # type: ignore[attr-defined]
    server.http_server = new
    if getattr(server, "services", {}).get("dashboard") is http:
        server.services["dashboard"] = new
    logger.info("dataservice: %s %s: its HTTP server (%s) serves mutual TLS with the "
                "cluster's certificates", role, server.address,
                ", ".join(f"{h}:{p}" for h, p in addresses))
    return "restarted with tls"
