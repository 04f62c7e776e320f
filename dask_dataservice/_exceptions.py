"""What the package's error types share (see :mod:`dask_dataservice.errors`)."""

from __future__ import annotations


class PlainMessage(Exception):  # noqa: N818 - a mixin, not an error of its own
    """``str(error)`` is the message, even when a builtin base such as KeyError would quote it.

    ``KeyError.__str__`` comes before ``BaseException.__str__`` in the MRO of errors that are
    also KeyErrors and would print ``"'Job 5000 not found'"``; this mixin restores the plain form.
    """

    def __str__(self) -> str:
        return BaseException.__str__(self)
