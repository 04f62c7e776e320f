"""The cardinality of a dataset read from the service, and why it is unknown when it is.

TensorFlow's ``distribute``/``from_dataset_id`` report ``INFINITE`` for coordinated reads
and for an infinite dataset under OFF, DYNAMIC and DATA sharding, ``0`` for an empty one,
and ``UNKNOWN`` otherwise: a finite dataset never has a known cardinality once distributed.
We report the same, except where the number of elements a pass yields is determined by what
the registration said of the pipeline: its cardinality ``N`` and whether its ops keep one
element per element (``count_preserving``, in the registered metadata). ``distribute`` knows
both (no RPC); a ``from_dataset_id`` dataset asks the dispatcher for them once, on its first
``cardinality()``/``len()`` (never from a repr: ``REPR_ONLY``), by its credential:

- a private job (no ``job_name``: this consumer reads every element the job produces) under
  DYNAMIC, FILE, DATA, FILE_OR_DATA or HINT sharding of a pipeline whose ops above the source
  keep one element per element (``map``, ``shuffle``, ``prefetch``, ``enumerate``, ``scan``,
  ``cache``): every source element is produced once by some data worker, so a pass yields
  the pipeline's own cardinality ``N`` (when no data worker fails: DYNAMIC then visits at most
  once). With ops that combine or drop elements (``batch``, ``take``, ``filter``...), each
  worker runs them on its own share: the count depends on the shares, so it is UNKNOWN.

Everywhere else it stays UNKNOWN, and :func:`why_unknown` says why (``len()`` shows it):
OFF sharding yields ``N`` times the number of data workers (not known in advance); a named
job shares its elements between its consumers first come first served. The dataset's own
cardinality (all consumers together) is ``DistributedDataset.total_cardinality()``.
"""

from __future__ import annotations

from ...data._base import INFINITE, UNKNOWN, Op
from ..protocol._sharding import ShardingPolicy

__all__ = ["count_preserving", "service_cardinality", "why_unknown"]

#: Ops that yield exactly one element per input element, whatever part of the input they see.
_ONE_TO_ONE = frozenset({"map", "shuffle", "prefetch", "enumerate", "scan", "cache"})


def count_preserving(op: Op) -> bool:
    """Whether every op above the (single) source of ``op``'s pipeline keeps one element per
    element, so that the pipeline run on parts of the source yields ``N`` in total."""
    while not op.is_source:
        if len(op.inputs) != 1 or op.name not in _ONE_TO_ONE:
            return False
        op = op.inputs[0]
    return True


def service_cardinality(mode: int, job_name: str | None, coordinated: bool,
                        total: int | None, preserving: bool) -> int:
    """The cardinality of one pass of a ``from_dataset_id`` read (see the module docstring):
    ``total`` is the registered pipeline's (None: not known in this process)."""
    if coordinated:
        return INFINITE  # coordinated reads need an infinite dataset (TensorFlow's answer)
    if total is None or total == UNKNOWN:
        return UNKNOWN
    if total == 0:
        return 0
    if total == INFINITE:
        static = mode in (ShardingPolicy.FILE, ShardingPolicy.FILE_OR_DATA, ShardingPolicy.HINT)
        return UNKNOWN if static else INFINITE
    if job_name is not None or mode == ShardingPolicy.OFF or not preserving:
        return UNKNOWN
    return total


def why_unknown(mode: int, job_name: str | None, total: int | None, preserving: bool) -> str:
    """Why :func:`service_cardinality` is UNKNOWN, for ``len()``'s error."""
    if total is None:
        return "the dataset's cardinality is not known to this process"
    if total == UNKNOWN:
        return "the registered pipeline's own cardinality is unknown"
    if total == INFINITE:
        return (f"the dataset is infinite, but {ShardingPolicy(mode).name} sharding may leave "
                "a worker's shard empty")
    if job_name is not None:
        return (f"the consumers of the shared job {job_name!r} split its elements between them "
                f"first come first served; the dataset has {total} elements in all "
                "(total_cardinality())")
    if mode == ShardingPolicy.OFF:
        return (f"under OFF sharding every data worker produces the whole dataset ({total} "
                "elements), so a pass yields that many times the number of data workers")
    return (f"under {ShardingPolicy(mode).name} sharding each data worker runs the pipeline on "
            "its own share of the source, and an op of it (batch, take, filter, ...) does not "
            f"keep one element per element; the pipeline has {total} elements when read whole "
            "(total_cardinality())")
