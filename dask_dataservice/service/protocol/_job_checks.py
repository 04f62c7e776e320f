"""What a job request may ask: the dispatcher's validations of processing modes, target
workers and dataset cardinalities, and the static worker list. Pure functions (no state, no
scheduler; :func:`check_mode` logs the policy FILE_OR_DATA chose): :mod:`..dispatcher.plugin`
calls them before it builds any update."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from ..._rpc import strip_protocol
from ...data._base import INFINITE, UNKNOWN
from ...errors import JobAccessDeniedError
from ._sharding import STATIC_POLICIES, ShardingPolicy

if TYPE_CHECKING:
    from ..dispatcher._entities import Dataset

logger = logging.getLogger(__name__)

__all__ = [
    "JobAccessDeniedError",
    "ShardMap",
    "check_job_token",
    "check_mode",
    "check_target_workers",
    "why_not_file_sharding",
    "require_shared_infinite",
    "shard_index",
    "worker_list",
]


def require_shared_infinite(feature: str, verb: str, job_name: str | None, dataset: Dataset, *,
                             unknown_ok: bool = False) -> None:
    """Coordinated reads and the cross-trainer cache: a named job over an endless dataset.

    Coordinated reads refuse only a *known finite* cardinality, as TensorFlow does (its own
    example, a ``flat_map``, has an unknown one): ``unknown_ok=True``.
    """
    if job_name is None:
        raise ValueError(f"{feature} {verb} a job_name")
    cardinality = dataset.metadata.get("cardinality")
    if cardinality == INFINITE or (unknown_ok and cardinality in (UNKNOWN, None)):
        return
    raise ValueError(
        f"{feature} {verb} an infinite dataset (end the pipeline with .repeat()); dataset "
        f"{dataset.dataset_id} has cardinality {_cardinality_name(cardinality)}"
    )


def check_target_workers(mode: ShardingPolicy, target_workers: str,
                          num_consumers: int | None) -> None:
    """The combinations TensorFlow refuses, each with the reason."""
    if num_consumers is not None and target_workers == "LOCAL":
        raise ValueError(
            "coordinated reads (num_consumers) read every round from one worker in turn, "
            "which cannot be limited to local workers: use target_workers='AUTO' or 'ANY', "
            "not 'LOCAL'")
    if mode in STATIC_POLICIES and target_workers == "ANY":
        raise ValueError(
            f"static sharding ({mode.name}) reads each worker's shard from that worker's "
            "host: target_workers='ANY' is not allowed (use 'AUTO' or 'LOCAL')")


def worker_list(entries: Iterable[str]) -> list[str]:
    """The static worker list as strings (config files may give names as numbers)."""
    return [str(entry) for entry in entries]


def _cardinality_name(n: int | None) -> str:
    return {INFINITE: "INFINITE", UNKNOWN: "UNKNOWN", None: "UNKNOWN"}.get(n, str(n))


def check_mode(mode: ShardingPolicy, dataset: Dataset,
               worker_addresses: Sequence[str] | None) -> ShardingPolicy:
    """Validate a processing mode for a dataset; FILE_OR_DATA resolves to FILE or DATA.

    FILE_OR_DATA is FILE when file sharding applies (a list of files, at least one per
    worker) and DATA otherwise, as TensorFlow's ``FILE_OR_DATA`` and ``AUTO`` fall back; a
    log line says which and why. FILE where it does not apply is a ValueError saying why.
    """
    if mode == ShardingPolicy.DYNAMIC and not dataset.splittable:
        reason = dataset.metadata.get("why_not_splittable") or "it has no splits"
        raise ValueError(
            f"dataset {dataset.dataset_id} cannot be read with DYNAMIC sharding: {reason}"
        )
    if mode not in STATIC_POLICIES:
        return mode
    if not worker_addresses:
        raise ValueError(
            f"sharding policy {mode.name} needs a fixed list of workers: start the "
            "dispatcher with DispatcherConfig(worker_addresses=[...]) (or the config "
            "key dataservice.dispatcher.worker-addresses)"
        )
    if mode not in (ShardingPolicy.FILE, ShardingPolicy.FILE_OR_DATA):
        return mode
    why_not = why_not_file_sharding(dataset, len(worker_addresses))
    if mode == ShardingPolicy.FILE_OR_DATA:
        if why_not is None:
            logger.info("dataservice: FILE_OR_DATA sharding of dataset %s chose FILE: its %d "
                        "files are shared among %d workers", dataset.dataset_id,
                        dataset.num_splits, len(worker_addresses))
            return ShardingPolicy.FILE
        logger.info("dataservice: FILE_OR_DATA sharding of dataset %s chose DATA, since FILE "
                    "sharding does not apply: %s", dataset.dataset_id, why_not)
        return ShardingPolicy.DATA
    if why_not is not None:
        raise ValueError(f"FILE sharding does not apply: {why_not} (use DATA or FILE_OR_DATA)")
    return mode


def why_not_file_sharding(dataset: Dataset, num_workers: int) -> str | None:
    """Why FILE sharding cannot give each of ``num_workers`` workers whole files, or None."""
    metadata = dataset.metadata
    if "why_not_file_shardable" in metadata:
        why_not = metadata["why_not_file_shardable"]
    else:  # registered by an older version: its word on files only
        why_not = None if metadata.get("file_based") else "the dataset is not read from files"
    if why_not:
        return f"dataset {dataset.dataset_id}: {why_not}"
    if dataset.num_splits < num_workers:
        return (f"dataset {dataset.dataset_id} has {dataset.num_splits} files, fewer than the "
                f"{num_workers} workers: not enough for the required {num_workers} "
                "shards/workers (each worker reads whole files)")
    return None


#: TensorFlow's port wildcard in ``DispatcherConfig.worker_addresses`` (``"host:%port%"``).
ANY_PORT = "%port%"


def _host_port(entry: str) -> tuple[str, str | None]:
    """``(host, port)`` of a worker-list entry or address; port None for a bare host (or a
    Dask worker name), ``"%port%"`` for TensorFlow's wildcard."""
    bare = entry.split("://", 1)[-1]  # not strip_protocol: it parses the port
    host, sep, port = bare.rpartition(":")
    if not sep or not (port.isdigit() or port == ANY_PORT) or (":" in host and not host.endswith("]")):
        return bare, None  # no port (an IPv6 literal without brackets has colons of its own)
    return host.strip("[]"), port


def names_a_host(entry: str) -> bool:
    """Whether a worker-list entry stands for any worker of a host (``"host:%port%"``, or a
    bare name with a dot or a colon: an IP address or a domain name), which may repeat."""
    host, port = _host_port(entry)
    return port == ANY_PORT or (port is None and ("." in host or ":" in host))


class ShardMap:
    """A static job's worker list as lookups (:func:`shard_index`'s rules), built once per
    job: a worker's shard costs O(1 + entries of its host), not a scan of the whole list (a
    job of 10,000 listed workers scanned 50 million entries to start)."""

    def __init__(self, entries: Iterable[str]) -> None:
        #: ``{entry: its first position}``: entries naming one worker (or a name).
        self.exact: dict[str, int] = {}
        #: ``{host: [positions]}``: entries that stand for any worker of a host.
        self.by_host: dict[str, list[int]] = {}
        for i, entry in enumerate(entries):
            self.exact.setdefault(entry, i)
            entry_host, port = _host_port(entry)
            if port in (None, ANY_PORT):
                self.by_host.setdefault(entry_host, []).append(i)

    def index(self, address: str, name: object = None,
              taken: Callable[[int], bool] = lambda i: False) -> int | None:
        """``address``'s position (see :func:`shard_index`); ``taken(i)``: whether another
        live worker of the iteration holds shard ``i`` (asked only for its host's entries)."""
        keys = {address, strip_protocol(address)}
        if name is not None:
            keys.add(str(name))
        named = [i for i in map(self.exact.get, keys) if i is not None]
        if named:
            return min(named)
        host, _ = _host_port(address)
        return next((i for i in self.by_host.get(host, ()) if not taken(i)), None)


def shard_index(entries: Iterable[str], address: str, name: object = None,
                taken: Iterable[int] = ()) -> int | None:
    """A worker's position in a static job's worker list; None if it is not listed.

    An entry names one worker by its address, its ``host:port`` or its Dask name; or, as in
    TensorFlow, any worker of a host: ``"host"`` or ``"host:%port%"`` (the host as the
    worker's address has it: Dask resolves host names, and ``DispatchServer`` resolves the
    entries' names when it starts). A worker takes the first entry naming it, else the first
    entry of its host whose shard is not in ``taken`` (the shards other live workers of the
    iteration hold), so that several workers of one host get one shard each. (The
    dispatcher keeps a :class:`ShardMap` per job instead of calling this.)
    """
    return ShardMap(entries).index(address, name, set(taken).__contains__)


def resolve_entry_hosts(entries: Iterable[str]) -> list[str]:
    """``entries`` with each ``host:port`` / ``host:%port%`` host name resolved to its IP
    address, as Dask resolves workers' addresses (bare entries may be worker names: kept).

    Blocking (DNS): call it where blocking is fine, e.g. in the user's thread as
    ``DispatchServer`` does, never on an event loop.
    """
    from distributed.comm.addressing import get_address_host, resolve_address

    out = []
    for entry in entries:
        host, port = _host_port(entry)
        if port is not None:
            try:  # Dask's own resolution, as it resolves the workers' addresses
                resolved = get_address_host(resolve_address(f"tcp://{host}:1"))
            except (OSError, ValueError):
                resolved = host  # not resolvable here: matched as written
            prefix = entry[: len(entry) - len(entry.split("://", 1)[-1])]
            entry = f"{prefix}{resolved}:{port}"
        out.append(entry)
    return out


def check_job_token(expected: str, given: str | None, job_id: int, what: str) -> None:
    """Refuse ``what`` on job ``job_id`` unless ``given`` is the job's token.

    A job without a token (``""``: created from a journal written before tokens existed)
    is not checked. The comparison takes constant time.
    """
    if not expected:
        return
    if not isinstance(given, str) or not hmac.compare_digest(expected, given):
        raise JobAccessDeniedError(
            f"{what} of job {job_id} refused: the request does not carry the job's token (only "
            "the job's consumers, which got it from distribute/from_dataset_id, and its data "
            "workers may)"
        )
