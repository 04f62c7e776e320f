"""The dispatcher's access rules (issue 11 §6): job capabilities, worker keys and limits.

- **Job tokens.** Every job gets a random token (``CreateJob.token``, journaled: a restarted
  dispatcher knows it). The job's consumers get it in the job creation reply (a named job's
  consumers share it: whoever can name the job may join it, as in TensorFlow), its data
  workers in each task definition. Reading elements, creating an iteration, and taking,
  acknowledging or finishing splits need it (:func:`~._job_checks.check_job_token`).
- **Worker keys.** Each data worker gets a random key, sent only over the scheduler's own
  stream to it (:mod:`._worker_key`); a heartbeat (whose reply carries task definitions, so
  tokens) and a pipeline download need it. Not journaled: a new dispatcher draws new keys
  and workers ask again.
- **Limits.** A registered pipeline with its splits may take at most
  ``dataservice.dispatcher.max-pipeline-bytes``, and one client (by its Dask client id) may
  register at most ``dataservice.dispatcher.max-datasets-per-client`` new datasets per
  dispatcher lifetime (re-registering a known dataset is free).
"""

from __future__ import annotations

import hmac
import secrets
from typing import Any

from dask.utils import format_bytes

from ... import config
from ...errors import DataServiceError
from ..protocol._job_checks import JobAccessDeniedError
from ..protocol._messages import WORKER_KEY_OP

__all__ = ["AccessGuard", "new_token", "redact_summary"]


def new_token() -> str:
    """A fresh random secret (192 bits)."""
    return secrets.token_urlsafe(24)


class AccessGuard:
    """Worker keys and registration limits of one dispatcher start."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        #: ``{worker address: key}``.
        self._keys: dict[str, str] = {}
        #: ``{client id: datasets it registered}`` since this start.
        self._registrations: dict[str, int] = {}
        max_bytes = config.get("dispatcher.max-pipeline-bytes")
        self.max_pipeline_bytes = (None if max_bytes is None
                                   else config.get_bytes("dispatcher.max-pipeline-bytes"))
        limit = config.get("dispatcher.max-datasets-per-client")
        self.max_datasets_per_client = None if limit is None else int(limit)

    # Worker keys
    def send_key(self, address: str) -> None:
        """Send worker ``address`` its key over the scheduler's stream to it (never in a reply)."""
        if address not in self.scheduler.workers:
            raise DataServiceError(f"{address} is not a worker of this scheduler")
        key = self._keys.get(address)
        if key is None:
            key = self._keys[address] = new_token()
        self.scheduler.worker_send(address, {"op": WORKER_KEY_OP, "key": key})

    def check_worker(self, address: str, key: str | None, what: str) -> None:
        expected = self._keys.get(address)
        if expected is None or not isinstance(key, str) or not hmac.compare_digest(expected, key):
            raise JobAccessDeniedError(
                f"{what} refused: only data workers may ask, with the key the dispatcher sent "
                f"to {address or 'the worker'} (ask for it with dataservice_worker_key)")

    def forget_worker(self, address: str) -> None:
        self._keys.pop(address, None)

    # Limits
    def check_pipeline_size(self, size: int) -> None:
        if self.max_pipeline_bytes is not None and size > self.max_pipeline_bytes:
            raise ValueError(
                f"the dataset's pickled pipeline and splits take {format_bytes(size)}, more than "
                f"the dispatcher accepts ({format_bytes(self.max_pipeline_bytes)}, config "
                "dataservice.dispatcher.max-pipeline-bytes): read large data from storage "
                "inside the pipeline instead of capturing it")

    def count_registration(self, client_id: str | None) -> None:
        """One more new dataset of ``client_id``; refuse it beyond the limit."""
        registered = self._registrations.get(str(client_id), 0)
        limit = self.max_datasets_per_client
        if limit is not None and registered >= limit:
            raise ValueError(
                f"client {client_id} already registered {registered} datasets, the most the "
                "dispatcher accepts from one client (config "
                "dataservice.dispatcher.max-datasets-per-client)")
        self._registrations[str(client_id)] = registered + 1


def redact_summary(state: Any, job_token: str | None) -> dict[str, Any]:
    """``state.summary()`` as a caller with ``job_token`` (or none) may see it.

    Everyone sees names and counts: dataset ids, worker addresses, jobs (name, dataset,
    mode, status) and per iteration its status, clients, ``num_tasks`` by status and
    ``num_lost_splits``. The iterations of the job whose token is ``job_token`` also show
    their ``tasks`` and ``lost_splits``. A token that is no job's is refused
    (:class:`JobAccessDeniedError`), so a typo is not silently a smaller view.
    """
    summary: dict[str, Any] = state.summary()
    allowed: set[int] = set()
    if job_token is not None:
        allowed = {j.job_id for j in state.list_jobs()
                   if j.token and isinstance(job_token, str)
                   and hmac.compare_digest(j.token, job_token)}
        if not allowed:
            raise JobAccessDeniedError(
                "the state view refused: the job token given is the token of no job")
    for iteration in summary["iterations"].values():
        counts: dict[str, int] = {}
        for task in iteration["tasks"]:
            counts[task["status"]] = counts.get(task["status"], 0) + 1
        iteration["num_tasks"] = counts
        iteration["num_lost_splits"] = len(iteration["lost_splits"])
        if iteration["job_id"] not in allowed:
            del iteration["tasks"], iteration["lost_splits"]
    return summary
