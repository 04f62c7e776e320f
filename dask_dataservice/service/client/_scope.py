"""Registration keys: which registrations of one pipeline share a dataset (issue 22).

Registering a pipeline answers its credential, and registering the same pipeline again
answers the same one, so that several trainers share a dataset (and its named jobs) without
passing the id around, as in TensorFlow. On a shared cluster that makes the credential only
as secret as the pipeline: whoever can rebuild ``Dataset.range(20_000)`` gets it. A
registration key (``dataservice.client.registration-key``, or
``DASK_DATASERVICE__CLIENT__REGISTRATION_KEY``; any secret string a user's trainers share)
scopes that sharing: the fingerprint the dispatcher dedupes on is suffixed with
``HMAC-SHA256(key, fingerprint)``, so the same pipeline registered with another key, or
with none, is another dataset with another secret, and its named job ``"train"`` another
job. The key never leaves the client; the tag names one pipeline only, so a leaked tag
gives no other dataset's credential.
"""

from __future__ import annotations

import hashlib
import hmac

from ... import config

__all__ = ["NAME_SCOPE", "name_scope", "scoped_fingerprint"]

TAG = "/scope="


def scoped_fingerprint(fingerprint: str, key: object = None) -> str:
    """``fingerprint`` in the scope of ``key`` (default: ``dataservice.client.registration-key``).

    Without a key the fingerprint is unchanged (TensorFlow's behaviour). A key that is not a
    non-empty string is a ``TypeError`` naming the config key.
    """
    if key is None:
        key = config.get("client.registration-key")
    if key is None:
        return fingerprint
    if not isinstance(key, str) or not key:
        raise TypeError("config dataservice.client.registration-key must be a non-empty string "
                        f"or null, got {type(key).__name__}")
    tag = hmac.new(key.encode(), fingerprint.encode(), hashlib.sha256).hexdigest()[:32]
    return f"{fingerprint}{TAG}{tag}"


#: The metadata key of a named registration's scope (see :func:`name_scope`).
NAME_SCOPE = "name_scope"


def name_scope(dataset_id: str | None, key: object = None) -> str | None:
    """The tag of a ``register_dataset(..., dataset_id=name)`` under a registration key.

    TensorFlow registers nothing new when a name is in use: the name's dataset is returned,
    whatever the pipeline (if its structure matches). With a key, that holds only for
    registrations with the same key: the dispatcher compares this tag (``HMAC-SHA256(key,
    name)``), so a stranger who knows the name cannot obtain the dataset's credential by
    registering another pipeline under it. None without a key or a name.
    """
    if dataset_id is None:
        return None
    if key is None:
        key = config.get("client.registration-key")
    if key is None:
        return None
    scoped_fingerprint("", key)  # checks the key
    assert isinstance(key, str)
    return hmac.new(key.encode(), f"dataset_id:{dataset_id}".encode(),
                    hashlib.sha256).hexdigest()[:32]
