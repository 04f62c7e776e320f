"""TensorFlow's service addresses: ``"grpc://host:port"``, ``"host:port"`` and
``(protocol, address)`` tuples, as Dask addresses.

A TensorFlow program names its dispatcher as ``FLAGS.tf_data_service_address``, usually
``"grpc://host:port"``, or as a ``(protocol, address)`` tuple. Dask speaks its own
protocols (``tcp``, ``tls``, ``ws``...), so TensorFlow's gRPC names are mapped onto them:

- ``"grpc"`` (TensorFlow's default protocol, also what a bare ``"host:port"`` means) and
  ``"grpc+local"`` are *this cluster's own protocol*: ``tls`` when this process is set up to
  talk TLS to the scheduler (a ``distributed.Client`` of ``tls://host:port`` is open in this
  process, or Dask's ``distributed.comm.require-encryption`` is set), ``tcp`` otherwise;
- ``"grpc+tls"`` is ``tls``;
- a Dask protocol (``tcp``, ``tls``, ``ws``, ``wss``, ``inproc``, ``ucx``) is kept.

Anything else is a ``ValueError`` naming the protocols that work (TensorFlow's own error for an
unknown protocol comes later, from the first read).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import dask

from ..._rpc import normalize_address

__all__ = ["GRPC", "dask_protocol", "parse_service"]

#: TensorFlow's names for "the service's own protocol".
GRPC = frozenset({"grpc", "grpc+local"})
#: Dask's comm backends (``distributed.comm.registry.backends``).
DASK = frozenset({"tcp", "tls", "ws", "wss", "inproc", "ucx"})


def dask_protocol(protocol: str | None, location: str | None = None,
                  known: Iterable[str] = ()) -> str:
    """The Dask protocol for TensorFlow's (or Dask's) ``protocol`` name.

    ``known``: the full addresses of the clients open in this process (a client of
    ``tls://location`` makes ``grpc`` mean ``tls`` for that location).
    """
    name = "grpc" if protocol is None or protocol == "" else protocol
    if not isinstance(name, str):
        raise TypeError(f"the protocol must be a string, got {type(protocol).__name__}")
    name = name.strip().lower()
    if name in GRPC:
        if location is not None and f"tls://{location}" in set(known):
            return "tls"
        return "tls" if dask.config.get("distributed.comm.require-encryption", None) else "tcp"
    if name == "grpc+tls":
        return "tls"
    if name in DASK:
        return name
    raise ValueError(
        f"unknown protocol {protocol!r}: use 'grpc' (TensorFlow's; here the cluster's own "
        "protocol, tcp or tls), 'grpc+tls', or a Dask protocol ('tcp', 'tls', 'ws', 'wss', "
        "'inproc', 'ucx')")


def parse_service(service: Any, known: Callable[[], Iterable[str]] = tuple) -> str:
    """The full Dask address of ``service``: an address string (``"grpc://host:port"``,
    ``"host:port"``, ``"tcp://host:port"``...) or a ``(protocol, address)`` tuple.

    ``known`` returns the addresses of the clients open in this process (see
    :func:`dask_protocol`). Raises ``TypeError`` for another type, ``ValueError`` for an
    empty or malformed address or an unknown protocol.
    """
    if isinstance(service, tuple):
        if len(service) != 2 or not all(isinstance(part, str) for part in service):
            raise ValueError(
                "a service tuple must be (protocol, address), two strings, e.g. "
                f"('grpc', 'localhost:5050'); got {service!r:.80}")
        protocol, location = service[0], service[1].strip()
        if "://" in location:
            raise ValueError(
                f"the address of a (protocol, address) service tuple has no protocol of its "
                f"own: got {service!r:.80}")
    elif isinstance(service, str):
        if not service.strip():
            raise ValueError("service must not be empty: give the dispatcher's address, "
                             "e.g. 'grpc://localhost:5050' or a distributed.Client")
        text = service.strip()
        if text.count("://") > 1:
            raise ValueError(f"malformed service address {service!r}: more than one '://'")
        protocol, _, location = text.rpartition("://")
        protocol = protocol or "grpc"  # no protocol: TensorFlow's default
    else:
        raise TypeError(
            "service must be a distributed.Client or a scheduler address such as "
            "'grpc://host:8786', 'tcp://host:8786' or a ('grpc', 'host:8786') tuple, got "
            f"{type(service).__name__} {service!r:.60}")
    if not location:
        raise ValueError(f"service {service!r} names no address (host:port)")
    grpc = isinstance(protocol, str) and protocol.strip().lower() in GRPC
    scheme = dask_protocol(protocol, location, known() if grpc else ())
    return normalize_address(f"{scheme}://{location}")
