"""Import Keras 3 on the JAX backend (the only one the adapter runs on today).

Keras reads ``KERAS_BACKEND`` once, when it is first imported: if Keras is not imported yet
and the variable is unset, it is set to ``"jax"`` here (Keras' own default is TensorFlow,
which this project does without). A Keras already imported on another backend is refused
with an error that says what to set.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..data.formats import optional_import

__all__ = ["jax", "keras"]

if "keras" not in sys.modules:
    os.environ.setdefault("KERAS_BACKEND", "jax")

keras: Any = optional_import("keras", "keras", "dask_dataservice.keras")
jax: Any = optional_import("jax", "keras", "dask_dataservice.keras")

if keras.backend.backend() != "jax":
    raise ImportError(
        f"dask_dataservice.keras runs Keras on the JAX backend, but Keras was imported with "
        f"the {keras.backend.backend()!r} backend: set KERAS_BACKEND=jax before Keras is "
        "imported (in every process: the coordinator and the training workers)")
