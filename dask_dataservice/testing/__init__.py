"""Test support shipped with the package (as ``zarr.testing`` and ``distributed.utils_test`` are).

- :func:`gen_cluster`: distributed's ``gen_cluster`` (which already checks leaked threads,
  processes, clients and comms), plus the project's own cleanup asserts once the test body
  returns: the dispatcher holds no live iteration client and no task of a collected iteration,
  every data worker has dropped its tasks and joined their threads, the PS plugins hold no
  in-flight work. A test that legitimately leaves state behind passes ``cleanup=False``.
- ``assert_dispatcher_cleanup``, ``assert_data_worker_cleanup``, ``assert_ps_cleanup``: the
  asserts themselves, for tests that build their clusters by hand.
- Fakes for the component tier live in the submodules (``testing.fakes``).

Everything here is for tests: nothing in the package imports it.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from distributed.utils_test import gen_cluster as _gen_cluster

from ._data_worker import assert_data_worker_cleanup
from ._dispatcher import assert_dispatcher_cleanup
from ._ps import assert_ps_cleanup

if TYPE_CHECKING:
    from distributed import Scheduler, Worker

__all__ = [
    "assert_cleanup",
    "assert_data_worker_cleanup",
    "assert_dispatcher_cleanup",
    "assert_ps_cleanup",
    "gen_cluster",
]


async def assert_cleanup(scheduler: Scheduler, workers: Sequence[Worker], timeout: float = 10.0) -> None:
    """Every plugin of this project on ``scheduler`` and ``workers`` is back to idle."""
    await assert_dispatcher_cleanup(scheduler, timeout=timeout)
    await assert_data_worker_cleanup(*workers, timeout=timeout)
    await assert_ps_cleanup(*workers, timeout=timeout)


def gen_cluster(
    *, cleanup: bool = True, **kwargs: Any
) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Any]]:
    """``distributed.utils_test.gen_cluster`` + :func:`assert_cleanup` after the test body.

    Takes the same keyword arguments. ``Worker=Nanny`` tests get the check on the scheduler
    only (their workers live in other processes).
    """

    def decorate(func: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        @functools.wraps(func)
        async def test(*args: Any, **kw: Any) -> Any:
            result = await func(*args, **kw)
            if cleanup:
                scheduler, workers = _servers(args, kwargs.get("client", False))
                if scheduler is not None:
                    await assert_cleanup(scheduler, workers)
            return result

        return _gen_cluster(**kwargs)(test)

    return decorate


def _servers(args: tuple[Any, ...], with_client: bool) -> tuple[Scheduler | None, list[Worker]]:
    from distributed import Scheduler, Worker

    scheduler = next((a for a in args if isinstance(a, Scheduler)), None)
    workers = [a for a in args if isinstance(a, Worker)]
    return scheduler, workers
