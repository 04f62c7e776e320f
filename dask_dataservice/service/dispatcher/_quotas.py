"""What the dispatcher holds, bounded (issue 22): request fields, per host, in total.

Every check is O(1) in the state (a field's size is the request's own).

- **Fields.** Names (a dataset's chosen id, a job name, a fingerprint, a position) at most
  ``dataservice.dispatcher.max-name-length`` characters; ``element_spec`` and ``metadata`` at
  most ``dispatcher.max-field-bytes`` each; a pipeline with its splits at most
  ``dispatcher.max-pipeline-bytes`` (:class:`~.._access.AccessGuard`).
- **Per host.** New datasets registered from one host (the peer address of the connection
  the request came on, which a client cannot choose as it can its Dask client id) at most
  ``dispatcher.max-datasets-per-host`` per dispatcher start.
- **In total.** At most ``dispatcher.max-datasets`` datasets, ``dispatcher.max-jobs`` live
  jobs and ``dispatcher.max-dataset-bytes`` of pipelines, splits, specs and metadata.

Each refusal is a :class:`~dask_dataservice.errors.ServiceLimitError` naming the figure, the
limit and its config key. ``None`` disables a limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
from dask.utils import format_bytes

from ...errors import ServiceLimitError

if TYPE_CHECKING:
    from .state import DispatcherState

__all__ = ["Limits", "Quotas", "check_name"]


@dataclass(frozen=True)
class Limits:
    """The limits, as plain values (``None``: no limit)."""

    max_name_length: int | None = 1024
    max_field_bytes: int | None = 4 * 2**20
    max_datasets_per_host: int | None = 1000
    max_datasets: int | None = 10_000
    max_jobs: int | None = 100_000
    max_dataset_bytes: int | None = 4 * 2**30


def check_name(limits: Limits, what: str, value: object) -> None:
    """Refuse a name longer than ``max-name-length``."""
    n = limits.max_name_length
    if n is not None and isinstance(value, str | bytes) and len(value) > n:
        raise ServiceLimitError(
            f"{what} has {len(value):,} characters, more than the dispatcher accepts ({n:,}, "
            "config dataservice.dispatcher.max-name-length)")


def field_bytes(limits: Limits, what: str, value: Any) -> int:
    """The size of ``element_spec`` or ``metadata``; refuse it beyond ``max-field-bytes``."""
    if value is None:
        return 0
    if isinstance(value, bytes | bytearray | memoryview):
        size = len(value)
    else:
        try:
            size = len(msgpack.packb(value, use_bin_type=True))
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError(f"{what} must be plain data: {e}") from e
    n = limits.max_field_bytes
    if n is not None and size > n:
        raise ServiceLimitError(
            f"{what} takes {format_bytes(size)}, more than the dispatcher accepts "
            f"({format_bytes(n)}, config dataservice.dispatcher.max-field-bytes)")
    return size


@dataclass
class Quotas:
    """The counts the limits bound (kept by :class:`~.core.DispatcherCore`; not journaled:
    ``datasets``, ``jobs`` and ``bytes`` are recounted from the state at a restart, the
    per-host counts start again)."""

    limits: Limits = field(default_factory=Limits)
    #: ``{host: new datasets registered from it}`` since this start.
    per_host: dict[str, int] = field(default_factory=dict)
    datasets: int = 0
    live_jobs: int = 0
    bytes: int = 0

    @classmethod
    def of(cls, state: DispatcherState, limits: Limits) -> Quotas:
        """The counts of a state replayed from the journal (once per start: O(state))."""
        datasets = state.list_datasets()
        return cls(limits, datasets=len(datasets),
                   live_jobs=sum(not j.garbage_collected for j in state.list_jobs()),
                   bytes=sum(dataset_size(d.pipeline, d.splits, d.element_spec,
                                          field_bytes(Limits(max_field_bytes=None),
                                                      "metadata", d.metadata))
                             for d in datasets))

    def check_dataset(self, host: str | None, size: int) -> None:
        """One more dataset of ``size`` bytes from ``host``: refuse it beyond a limit."""
        lim = self.limits
        registered = self.per_host.get(host or "", 0)
        if lim.max_datasets_per_host is not None and registered >= lim.max_datasets_per_host:
            raise ServiceLimitError(
                f"host {host or '(unknown)'} already registered {registered:,} datasets, the "
                "most the dispatcher accepts from one host (config "
                "dataservice.dispatcher.max-datasets-per-host)")
        if lim.max_datasets is not None and self.datasets >= lim.max_datasets:
            raise ServiceLimitError(
                f"the dispatcher holds {self.datasets:,} datasets, the most it accepts (config "
                "dataservice.dispatcher.max-datasets)")
        if lim.max_dataset_bytes is not None and self.bytes + size > lim.max_dataset_bytes:
            raise ServiceLimitError(
                f"the dispatcher holds {format_bytes(self.bytes)} of datasets; "
                f"{format_bytes(size)} more would pass its limit of "
                f"{format_bytes(lim.max_dataset_bytes)} (config "
                "dataservice.dispatcher.max-dataset-bytes)")

    def add_dataset(self, host: str | None, size: int) -> None:
        self.per_host[host or ""] = self.per_host.get(host or "", 0) + 1
        self.datasets += 1
        self.bytes += size

    def check_job(self) -> None:
        lim = self.limits.max_jobs
        if lim is not None and self.live_jobs >= lim:
            raise ServiceLimitError(
                f"the dispatcher holds {self.live_jobs:,} live jobs, the most it accepts "
                "(config dataservice.dispatcher.max-jobs)")


def dataset_size(pipeline: bytes, splits: bytes, element_spec: bytes | None,
                 metadata_bytes: int) -> int:
    """The bytes a registered dataset holds in the dispatcher."""
    return len(pipeline) + len(splits) + len(element_spec or b"") + metadata_bytes
