"""Dataset credentials (issue 22): a dataset is read by a string id that holds its secret.

``register_dataset`` answers ``"<key>:<secret>"``: ``<key>`` is the dataset's numeric id, or
the name its user chose (TensorFlow's ``dataset_id``), and ``<secret>`` the random secret
the dispatcher drew when the dataset was first registered (192 bits, journaled with the
dataset: :class:`~._updates.RegisterDataset` field 10). Registering the same pipeline again
(under the same name, if any) answers the same string, so every trainer that registers the
pipeline gets it, as every TensorFlow trainer gets the id by registering. Whoever holds the
string may create and join the dataset's jobs, named ones included; a bare id or name, or a
wrong secret, names no dataset. Secrets never contain ``":"``, so the key is everything
before the last one (a name may contain ``":"``).

A dataset journaled before secrets existed has none and is read by its bare id or name.

A name already in use (``register_dataset(..., dataset_id=name)`` again) registers nothing
new, as in TensorFlow: the name's credential is answered, also for another pipeline, when its
structure matches (:func:`check_reuse`). A registration key scopes names as it scopes
pipelines: a registration under another key (or none) is refused, so knowing a name is not
enough to obtain its credential on a cluster whose users set keys.

A dataset the dispatcher garbage collected (no job for ``dispatcher.dataset-gc-timeout``)
leaves its numeric id as a tombstone: a credential with that id is told so, and to register
the pipeline again. (A collected dataset's name is freed with it and not remembered: a
credential with the name gets the message of an unknown one.)
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any

from ...errors import DatasetNotFoundError

if TYPE_CHECKING:
    from ._entities import Dataset
    from .state import DispatcherState

__all__ = ["check_reuse", "credential", "find_dataset", "label"]

SEPARATOR = ":"


def credential(dataset: Dataset) -> int | str:
    """The id ``register_dataset`` answers for ``dataset``: ``"<key>:<secret>"``."""
    if not dataset.secret:  # journaled before secrets existed
        return dataset.dataset_name if dataset.dataset_name is not None else dataset.dataset_id
    key = dataset.dataset_name if dataset.dataset_name is not None else str(dataset.dataset_id)
    return f"{key}{SEPARATOR}{dataset.secret}"


def label(dataset_id: object) -> str:
    """``dataset_id`` without its secret, for messages and logs."""
    if isinstance(dataset_id, str) and SEPARATOR in dataset_id:
        return dataset_id.rpartition(SEPARATOR)[0]
    return str(dataset_id)


def find_dataset(state: DispatcherState, dataset_id: object,
                 gc_timeout: float | None = None) -> Dataset:
    """The dataset whose credential is ``dataset_id`` (O(1)).

    ``gc_timeout``: the dispatcher's ``dataset-gc-timeout`` (seconds), for the message about
    a collected dataset.

    Raises
    ------
    DatasetNotFoundError
        For a wrong or missing secret as for an unknown key, with one message, so that a
        caller without the secret learns nothing of which names exist; for the numeric id
        of a collected dataset, with a message that says so (ids are sequential: that one
        existed is no secret).
    TypeError
        If ``dataset_id`` is neither an int nor a string.
    """
    if isinstance(dataset_id, bool) or not isinstance(dataset_id, int | str):
        raise TypeError(f"dataset_id must be the string register_dataset returned, got "
                        f"{type(dataset_id).__name__}")
    key: int | str = dataset_id
    secret: str | None = None
    if isinstance(dataset_id, str) and SEPARATOR in dataset_id:
        key, _, secret = dataset_id.rpartition(SEPARATOR)
    for candidate in _candidates(state, key):
        if candidate.secret:
            if secret is not None and hmac.compare_digest(candidate.secret, secret):
                return candidate
        elif secret is None:
            return candidate
    number = key if isinstance(key, int) else int(key) if key.isdigit() else None
    if number is not None and state.dataset_collected(number):
        after = "" if gc_timeout is None else f" ({gc_timeout:g}s)"
        raise DatasetNotFoundError(
            f"dataset {number} was garbage collected after being unused (no job) for "
            f"dataservice.dispatcher.dataset-gc-timeout{after}: register the pipeline again "
            "(register_dataset) and read it by the new id")
    raise DatasetNotFoundError(
        f"no dataset has the id {label(dataset_id)!r} with this secret: read a dataset by the "
        "string id register_dataset returned ('<id or name>:<secret>'; bare integer ids and "
        "names are not accepted, register the pipeline again to get its id)")


def _candidates(state: DispatcherState, key: int | str) -> list[Dataset]:
    found = []
    if isinstance(key, str):
        try:
            found.append(state.dataset_by_name(key))
        except DatasetNotFoundError:
            pass
        if key.isdigit():
            key = int(key)
    if isinstance(key, int):
        try:
            ds = state.dataset(key)
        except DatasetNotFoundError:
            pass
        else:
            if ds.dataset_name is None or not ds.secret:
                found.append(ds)
    return found


#: What TensorFlow compares when a name is registered again (its ``DataServiceMetadata``
#: besides the element spec, which is not known here: no element is produced at registration).
_STRUCTURE = ("cardinality",)


def check_reuse(existing: Dataset, name: str, fingerprint: str,
                metadata: dict[str, Any] | None, compression: str | None) -> None:
    """Whether a registration under ``name``, which ``existing`` holds, may share it.

    The same pipeline may; another one may when its structure matches TensorFlow's way
    (cardinality, compression) and it was registered under the same registration key
    (``metadata["name_scope"]``, :func:`~..client._scope.name_scope`; none on both sides
    without keys).

    Raises
    ------
    ValueError
        Naming the difference, or the other key.
    """
    if existing.fingerprint == fingerprint:
        return
    metadata = metadata or {}
    if existing.metadata.get("name_scope") != metadata.get("name_scope"):
        raise ValueError(
            f"dataset_id {name!r} is already registered for a different dataset, under another "
            "registration key (dataservice.client.registration-key); register this one under "
            "another id (or without one)")
    diffs = [f"{what} {existing.metadata.get(what)!r} (registered) vs {metadata.get(what)!r}"
             for what in _STRUCTURE if existing.metadata.get(what) != metadata.get(what)]
    if existing.compression != compression:
        diffs.append(f"compression {existing.compression!r} (registered) vs {compression!r}")
    if diffs:
        raise ValueError(
            f"dataset_id {name!r} is registered for a dataset of another structure: "
            f"{'; '.join(diffs)}. A name is shared by the datasets registered under it only "
            "when they have the same structure (as in TensorFlow): register this one under "
            "another id")
