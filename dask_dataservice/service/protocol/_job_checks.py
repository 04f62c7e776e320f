"""What a job request may ask: the dispatcher's validations of processing modes, target
workers and dataset cardinalities, and the static worker list. Pure functions (no state, no
scheduler): :mod:`..dispatcher.plugin` calls them before it builds any update."""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..._rpc import strip_protocol
from ...data._base import INFINITE, UNKNOWN
from ...errors import JobAccessDeniedError
from ._sharding import STATIC_POLICIES, ShardingPolicy

if TYPE_CHECKING:
    from ..dispatcher._entities import Dataset

__all__ = [
    "JobAccessDeniedError",
    "check_job_token",
    "check_mode",
    "check_target_workers",
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


def check_mode(mode: ShardingPolicy, dataset: Dataset, worker_addresses: list[str] | None) -> ShardingPolicy:
    """Validate a processing mode for a dataset; FILE_OR_DATA resolves to FILE or DATA."""
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
    file_based = bool(dataset.metadata.get("file_based"))
    if mode == ShardingPolicy.FILE_OR_DATA:
        mode = ShardingPolicy.FILE if file_based else ShardingPolicy.DATA
    if mode == ShardingPolicy.FILE:
        if not file_based:
            raise ValueError(
                f"FILE sharding needs a dataset read from files (list_files or "
                f"from_files); dataset {dataset.dataset_id} is not; use DATA or FILE_OR_DATA"
            )
        if dataset.num_splits < len(worker_addresses):
            raise ValueError(
                f"FILE sharding: dataset {dataset.dataset_id} has {dataset.num_splits} "
                f"files, fewer than the {len(worker_addresses)} workers; every worker "
                "needs at least one file (use DATA sharding, or fewer workers)"
            )
    return mode



def shard_index(entries: tuple[str, ...], address: str, name: object = None) -> int | None:
    """A worker's position in a static job's worker list, matched by its address, its
    ``host:port`` or its Dask name; None if it is not listed."""
    keys = {address, strip_protocol(address)}
    if name is not None:
        keys.add(str(name))
    for i, entry in enumerate(entries):
        if entry in keys:
            return i
    return None


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
