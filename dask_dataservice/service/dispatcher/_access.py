"""The dispatcher's access rules (issue 11 §6): job capabilities, worker keys and limits.

- **Job tokens.** Every job gets a random token (``CreateJob.token``, journaled: a restarted
  dispatcher knows it). The job's consumers get it in the job creation reply (a named job's
  consumers share it: whoever holds the dataset's credential and names the job may
  join it, as in TensorFlow), its data
  workers in each task definition. Reading elements, creating an iteration, and taking,
  acknowledging or finishing splits need it (:func:`~._job_checks.check_job_token`).
- **Worker keys.** Each data worker gets a random key, sent only over the scheduler's own
  stream to it (:mod:`._worker_key`); a heartbeat (whose reply carries task definitions, so
  tokens) and a pipeline download need it. Not journaled: a new dispatcher draws new keys
  and workers ask again.
- **Dataset credentials** (issue 22, :mod:`._credentials`): a dataset is read by the string
  id ``register_dataset`` answered, which holds its secret.
- **Limits.** A registered pipeline with its splits may take at most
  ``dataservice.dispatcher.max-pipeline-bytes``; every other field, each host and the
  dispatcher's total are bounded too (:mod:`._quotas`).
- **The state view** shows counts and worker addresses to anyone, a dataset's id and jobs
  only with its credential, a job's tasks only with its token (:func:`redact_summary`).
"""

from __future__ import annotations

import hmac
import secrets
from typing import Any

from dask.utils import format_bytes
from distributed.comm.addressing import get_address_host

from ... import config
from ...errors import DataServiceError, ServiceLimitError
from ..protocol._job_checks import JobAccessDeniedError
from ..protocol._messages import WORKER_KEY_OP
from ._credentials import find_dataset
from ._quotas import Limits

__all__ = ["AccessGuard", "limits_from_config", "new_token", "peer_host", "redact_summary"]


def new_token() -> str:
    """A fresh random secret (192 bits)."""
    return secrets.token_urlsafe(24)


class AccessGuard:
    """Worker keys and registration limits of one dispatcher start."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        #: ``{worker address: key}``.
        self._keys: dict[str, str] = {}
        max_bytes = config.get("dispatcher.max-pipeline-bytes")
        self.max_pipeline_bytes = (None if max_bytes is None
                                   else config.get_bytes("dispatcher.max-pipeline-bytes"))

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
            raise ServiceLimitError(
                f"the dataset's pickled pipeline and splits take {format_bytes(size)}, more than "
                f"the dispatcher accepts ({format_bytes(self.max_pipeline_bytes)}, config "
                "dataservice.dispatcher.max-pipeline-bytes): something in it (a function's "
                "closure or globals, a source's argument) captures large data. Pass arrays "
                "as Dataset.from_tensor_slices(...) sources or Dask collections as "
                "Dataset.from_dask(...) sources (registration moves those above "
                "dataservice.client.scatter-threshold to the workers through Dask), "
                "client.scatter() or persist() the data and read it with Dataset.from_dask(), "
                "or read it from storage inside the pipeline")


def limits_from_config() -> Limits:
    """The dispatcher's :class:`~._quotas.Limits` from ``dataservice.dispatcher.max-*``."""
    def count(key: str) -> int | None:
        value = config.get(f"dispatcher.{key}")
        return None if value is None else int(value)

    def nbytes(key: str) -> int | None:
        value = config.get(f"dispatcher.{key}")
        return None if value is None else config.get_bytes(f"dispatcher.{key}")

    return Limits(max_name_length=count("max-name-length"),
                  max_field_bytes=nbytes("max-field-bytes"),
                  max_datasets_per_host=count("max-datasets-per-host"),
                  max_datasets=count("max-datasets"), max_jobs=count("max-jobs"),
                  max_dataset_bytes=nbytes("max-dataset-bytes"))


def peer_host(comm: Any) -> str | None:
    """The host a request came from: its connection's peer address (which a client cannot
    choose as it chooses its client id), or None for a call made in process."""
    address = getattr(comm, "peer_address", None)
    if not address:
        return None
    try:
        return str(get_address_host(address))
    except (ValueError, TypeError):
        return str(address)


def redact_summary(state: Any, job_token: str | None,
                   dataset_id: str | None = None) -> dict[str, Any]:
    """``state.summary()`` as a caller with ``job_token`` or ``dataset_id`` (or neither) may
    see it.

    Everyone sees counts (``num_datasets``, ``num_jobs``, ``num_iterations``) and the data
    workers' addresses (any Dask client can list the workers anyway). Names and ids are not
    shown to a caller without a credential (issue 22): a dataset's credential
    (``dataset_id``, the string ``register_dataset`` returned) shows that dataset's id and its
    jobs (name, mode, status) with their iterations' status, clients, ``num_tasks`` by status
    and ``num_lost_splits``; a job's token shows that job and, besides, its iterations'
    ``tasks`` and ``lost_splits``. A token or credential that is no job's or dataset's is
    refused (:class:`JobAccessDeniedError`), so a typo is not silently a smaller view.
    """
    summary: dict[str, Any] = state.summary()
    datasets: set[int] = set()
    jobs: set[int] = set()
    detailed: set[int] = set()
    if dataset_id is not None:
        try:
            datasets.add(find_dataset(state, dataset_id).dataset_id)
        except (KeyError, TypeError):
            raise JobAccessDeniedError(
                "the state view refused: the dataset id given is no dataset's credential"
            ) from None
    if job_token is not None:
        detailed = {j.job_id for j in state.list_jobs()
                    if j.token and isinstance(job_token, str)
                    and hmac.compare_digest(j.token, job_token)}
        if not detailed:
            raise JobAccessDeniedError(
                "the state view refused: the job token given is the token of no job")
    jobs = detailed | {job_id for job_id, job in summary["jobs"].items()
                       if job["dataset_id"] in datasets}
    out: dict[str, Any] = {
        "num_datasets": len(summary["datasets"]), "num_jobs": len(summary["jobs"]),
        "num_iterations": len(summary["iterations"]), "workers": summary["workers"],
        "datasets": [d for d in summary["datasets"] if d in datasets],
        "jobs": {j: job for j, job in summary["jobs"].items() if j in jobs},
        "iterations": {},
    }
    for iteration_id, iteration in summary["iterations"].items():
        if iteration["job_id"] not in jobs:
            continue
        counts: dict[str, int] = {}
        for task in iteration["tasks"]:
            counts[task["status"]] = counts.get(task["status"], 0) + 1
        iteration["num_tasks"] = counts
        iteration["num_lost_splits"] = len(iteration["lost_splits"])
        if iteration["job_id"] not in detailed:
            del iteration["tasks"], iteration["lost_splits"]
        out["iterations"][iteration_id] = iteration
    return out
