"""Owned concurrency: every task, thread and wake-up a plugin starts goes through here.

- :class:`TaskGroup`: distributed's :class:`~distributed.core.AsyncTaskGroup` that also hands
  back the task it started and logs a task that died with an exception nobody awaited.
  A plugin keeps one; ``teardown``/``close`` awaits ``group.stop()``, which cancels and awaits
  every task still running. Nothing is started with a bare ``ensure_future``.
- :func:`owned_executor`: a named thread pool a plugin creates in ``setup`` and shuts down in
  ``teardown`` (:func:`shutdown_executor` joins its threads).
- :class:`LoopWaker`: the one way a thread wakes a coroutine on an event loop. Many ``wake()``
  calls from any thread before the loop runs the callback cost one ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from distributed._async_taskgroup import AsyncTaskGroup

__all__ = ["LoopWaker", "TaskGroup", "owned_executor", "shutdown_executor"]

logger = logging.getLogger(__name__)


class TaskGroup(AsyncTaskGroup):
    """An :class:`~distributed.core.AsyncTaskGroup` whose :meth:`spawn` returns the task.

    Call it on the event loop that runs the tasks. ``await group.stop()`` cancels them all and
    waits for them; :meth:`spawn` after ``close()``/``stop()`` raises
    :class:`~distributed.core.AsyncTaskGroupClosedError`.
    """

    def __init__(self, name: str = "tasks") -> None:
        super().__init__()
        self.name = name

    def spawn(
        self, afunc: Callable[..., Coroutine[Any, Any, Any]], /, *args: Any, **kwargs: Any
    ) -> asyncio.Task[Any]:
        """Start ``afunc(*args, **kwargs)`` as a task owned by this group; return the task."""
        if self.closed:
            super().call_soon(afunc, *args, **kwargs)  # raises AsyncTaskGroupClosedError
        loop: asyncio.AbstractEventLoop = self._get_loop()  # type: ignore[no-untyped-call]
        task: asyncio.Task[Any] = loop.create_task(afunc(*args, **kwargs))
        self._ongoing_tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def call_soon(
        self, afunc: Callable[..., Coroutine[Any, Any, Any]], /, *args: Any, **kwargs: Any
    ) -> None:
        self.spawn(afunc, *args, **kwargs)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._ongoing_tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()  # marks it retrieved: no "exception was never retrieved"
        if exc is not None and not getattr(task, "_dds_awaited", False):
            logger.debug("%s: background task %s ended with %r", self.name, task.get_name(), exc)

    @property
    def tasks(self) -> frozenset[asyncio.Task[Any]]:
        return frozenset(self._ongoing_tasks)


def owned_executor(name: str, max_workers: int = 1) -> ThreadPoolExecutor:
    """A thread pool named ``name`` (its threads are ``name_0``, ``name_1``, ...)."""
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)


def shutdown_executor(executor: ThreadPoolExecutor | None, wait: bool = True) -> None:
    """Cancel queued work and (by default) join the executor's threads."""
    if executor is not None:
        executor.shutdown(wait=wait, cancel_futures=True)


class LoopWaker:
    """Run ``callback`` on ``loop`` after ``wake()`` from any thread, once per burst.

    ``wake()`` calls that arrive before the loop ran the callback are folded into one
    ``call_soon_threadsafe``. The callback runs on the loop with no lock held; wake-ups after
    the loop closed are dropped (the owner is shutting down).
    """

    __slots__ = ("_callback", "_lock", "_loop", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], Any]) -> None:
        self._loop = loop
        self._callback = callback
        self._lock = threading.Lock()
        self._scheduled = False

    def wake(self) -> None:
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the loop is closed: nobody is left to wake
            with self._lock:
                self._scheduled = False

    def _run(self) -> None:
        with self._lock:
            self._scheduled = False
        self._callback()
