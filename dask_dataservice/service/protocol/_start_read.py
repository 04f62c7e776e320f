"""The dispatcher's ``dataservice_start_read``: a read's job and iteration in one round trip.

A read used to ask the dispatcher twice before it could fetch an element:
``get_or_create_job``, then ``get_or_create_iteration`` with the job's id and token. Each is a
round trip (1-2 ms on a loaded machine), the first part of the time to the first element
(issue 16, target 7). ``start_read`` runs the same two handlers one after the other in the
dispatcher and answers both replies: the same validation, journaling and errors, one round trip.
A reader falls back to the two requests when the dispatcher is older and has no such handler.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..._rpc import handler

__all__ = ["START_READ", "start_read", "start_read_handlers"]

#: The handler's name on the scheduler.
START_READ = "dataservice_start_read"


async def _call(fn: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    out = fn(**kwargs)
    if inspect.isawaitable(out):
        out = await out
    reply: dict[str, Any] = out
    return reply


def start_read_handlers(get_or_create_job: Callable[..., Any],
                        get_or_create_iteration: Callable[..., Any]) -> dict[str, Callable[..., Any]]:
    """``{START_READ: handler}`` over the dispatcher's two handlers."""

    @handler
    async def start_read(job: dict[str, Any], repetition: int = 0) -> dict[str, Any]:
        """``get_or_create_job(**job)``, then ``get_or_create_iteration`` of that job.

        Answers ``{"status": "OK", "job": <job reply>, "iteration": <iteration reply>}``, or the
        first reply that is not OK (an error, or ``closing``) as it is.
        """
        job_reply = await _call(get_or_create_job, **job)
        if job_reply.get("status") != "OK":
            return job_reply
        view = await _call(get_or_create_iteration, job_id=job_reply["job_id"],
                           repetition=repetition, job_token=job_reply.get("job_token"))
        if view.get("status") != "OK":
            return view
        return {"status": "OK", "job": job_reply, "iteration": view}

    return {START_READ: start_read}


async def start_read(scheduler: Any, job: dict[str, Any],
                     repetition: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The reader's side: ``(job reply, iteration view)``, in one round trip if the dispatcher
    has :data:`START_READ`, else in two (an older dispatcher)."""
    from ._messages import raise_for_status

    reply = await getattr(scheduler, START_READ)(job=job, repetition=repetition)
    if reply is not None:  # None: the scheduler does not know the request (older dispatcher)
        reply = raise_for_status(reply, "job creation")
        return reply["job"], reply["iteration"]
    job_reply = raise_for_status(await scheduler.dataservice_get_or_create_job(**job),
                                 "job creation")
    view = raise_for_status(await scheduler.dataservice_get_or_create_iteration(
        job_id=job_reply["job_id"], repetition=repetition,
        job_token=job_reply.get("job_token")), "iteration creation")
    return job_reply, view
