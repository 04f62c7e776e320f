"""Equal splits: N consumers of one DYNAMIC job deliver the same number of elements.

``from_dataset_id(..., consumer_index=i, num_consumers=N, equal="drop" | "pad")``: the
consumers of one iteration form an :class:`EqualGroup` here. Each reports how many elements
it holds (received, whether delivered yet or not) and whether its pass over the job ended;
the group answers how many it may deliver (``allowed``) and, once it is decided, how many
every consumer delivers in all (``final``).

Rules (pure: no clock, no I/O; the plugin parks a consumer's request until the answer
changes, the reader keeps its own side in :mod:`..client.equal_core`):

- A consumer may deliver its ``k``-th element only when every one of the ``N`` consumers
  holds at least ``k``: ``allowed = min(received)`` (0 until all ``N`` joined). A consumer
  that runs ahead fills its buffer and stops fetching, so the others take the rest of the
  job's elements: the split stays dynamic, and the consumers' holdings differ by at most
  one consumer's buffer.
- ``drop``: ``final = min(received)``, known once a consumer whose pass ended holds the
  minimum (its count cannot grow, the others' never shrink). What the others hold beyond it
  is dropped: at most each other consumer's buffer.
- ``pad``: once a consumer's pass ended the others may deliver all they get
  (``allowed`` unbounded: the short ones pad); ``final = max(received)``, known once every
  pass ended. A consumer short of it repeats elements it delivered earlier in the pass.
- The group fails, and every consumer's request answers the error, when a consumer leaves
  (is released: it stopped reading, or sent no heartbeat for ``client-timeout``) before the
  count was decided, or when not all ``N`` joined within ``client-timeout`` of the first.

The counts are soft state, not journaled: each report carries the consumer's absolute
count, which only grows, and its settings, so a restarted dispatcher rebuilds the group from
the next report of each consumer, and ``final`` is the same function of the same counts.

Each report costs O(1) amortized: ``min`` is kept with the number of consumers at it, and is
searched again (O(N)) only when the last of them moved on, that is at most once per ``N``
reports that raise a count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import DataServiceError

if TYPE_CHECKING:
    from .core import DispatcherCore

__all__ = ["REMAINDERS", "EqualGroup", "EqualGroups", "equal_sync"]

#: What happens to the elements past an equal count: ``drop`` them or ``pad`` to the most.
REMAINDERS = ("drop", "pad")


@dataclass
class EqualGroup:
    """The equal split of one iteration (see the module docstring)."""

    num_consumers: int
    remainder: str
    #: When the first consumer joined (seconds): the others must join within the timeout.
    created: float
    #: What the job is called in messages.
    label: str = ""
    #: ``received[i]``: what consumer ``i`` last reported holding (-1: not joined yet).
    received: list[int] = field(default_factory=list)
    #: ``clients[i]``: the iteration client of consumer ``i`` (None: not joined yet).
    clients: list[int | None] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)
    joined: int = 0
    num_ended: int = 0
    low: int = 0  # min(received) once every consumer joined
    at_low: int = 0  # consumers whose count is ``low``
    high: int = 0  # max(received)
    ended_low: int | None = None  # min(received) over the consumers whose pass ended
    final: int | None = None
    failed: str | None = None
    #: Changes each time ``allowed``, ``final`` or ``failed`` changes (parked requests wake).
    version: int = 0

    def __post_init__(self) -> None:
        n = self.num_consumers
        self.received = [-1] * n
        self.clients = [None] * n
        self.ended = [False] * n

    # Stimuli
    def report(self, index: int, client_id: int, num_consumers: int, remainder: str,
               received: int, ended: bool) -> None:
        """Consumer ``index`` (iteration client ``client_id``) holds ``received``; ``ended``:
        its pass is over (its count is final). Raises ``ValueError`` for a consumer whose
        settings differ from the group's or whose index another consumer holds."""
        if num_consumers != self.num_consumers:
            raise ValueError(
                f"consumer_index={index} reads {self.label} with num_consumers="
                f"{num_consumers}, but its other consumers use num_consumers="
                f"{self.num_consumers}: every consumer of an equal split must give the same")
        if remainder != self.remainder:
            raise ValueError(
                f"consumer_index={index} reads {self.label} with equal={remainder!r}, but its "
                f"other consumers use equal={self.remainder!r}: every consumer must give the same")
        if not 0 <= index < self.num_consumers:
            raise ValueError(f"need 0 <= consumer_index < num_consumers, got consumer_index="
                             f"{index}, num_consumers={self.num_consumers}")
        owner = self.clients[index]
        if owner is None:
            self.clients[index] = client_id
        elif owner != client_id:
            raise ValueError(
                f"consumer_index={index} of {self.label} is already read by another consumer: "
                f"give each of the {self.num_consumers} consumers its own index")
        if self.failed is not None:
            return
        before = self.allowed, self.final
        old = self.received[index]
        if received > old:
            self.received[index] = received
            self.high = max(self.high, received)
            if old < 0:
                self.joined += 1
                if self.joined == self.num_consumers:
                    self._find_low()
            elif self.joined == self.num_consumers and old == self.low:
                self.at_low -= 1
                if self.at_low == 0:
                    self._find_low()
        if ended and not self.ended[index]:
            self.ended[index] = True
            self.num_ended += 1
            count = self.received[index]
            self.ended_low = count if self.ended_low is None else min(self.ended_low, count)
        self._decide()
        if (self.allowed, self.final) != before:
            self.version += 1

    def left(self, client_id: int) -> None:
        """Iteration client ``client_id`` was released: a member that leaves before the count
        was decided fails the group (the others would wait for it forever)."""
        if self.final is not None or self.failed is not None:
            return
        for index, owner in enumerate(self.clients):
            if owner == client_id:
                self.fail(
                    f"consumer {index} of the {self.num_consumers} consumers of {self.label} "
                    "stopped reading before the equal count was decided (it left, or sent no "
                    "heartbeat for dataservice.dispatcher.client-timeout)")
                return

    def tick(self, now: float, timeout: float) -> None:
        """Fail the group if some consumer has not joined ``timeout`` seconds after the first."""
        if self.failed is None and self.joined < self.num_consumers \
                and now - self.created > timeout:
            missing = [i for i, c in enumerate(self.clients) if c is None]
            self.fail(
                f"consumer_index {', '.join(map(str, missing))} of {self.label} (num_consumers="
                f"{self.num_consumers}) never joined within dataservice.dispatcher."
                f"client-timeout={timeout:g}s of the first consumer: start every consumer, "
                "or give num_consumers as many as read")

    def fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            self.version += 1

    # Answers
    @property
    def allowed(self) -> int | None:
        """Elements each consumer may deliver so far (None: as many as it gets)."""
        if self.final is not None:
            return self.final
        if self.joined < self.num_consumers:
            return 0
        if self.remainder == "pad" and self.num_ended:
            return None
        return self.low

    def answer(self) -> dict[str, Any]:
        """The reply to a consumer (an error once the group failed)."""
        if self.failed is not None:
            raise DataServiceError(f"the equal split failed: {self.failed}")
        return {"status": "OK", "allowed": self.allowed, "final": self.final,
                "version": self.version}

    def waits(self, need: int, ended: bool = False) -> bool:
        """Whether a consumer that needs ``need`` allowed elements (``ended``: the final
        count) has to wait for a change."""
        if self.failed is not None or self.final is not None:
            return False
        allowed = self.allowed
        return ended or (allowed is not None and allowed < need)

    # Helpers
    def _find_low(self) -> None:
        self.low = min(self.received)
        self.at_low = self.received.count(self.low)

    def _decide(self) -> None:
        if self.final is not None or self.joined < self.num_consumers:
            return
        if self.remainder == "drop":
            if self.ended_low is not None and self.ended_low == self.low:
                self.final = self.low
        elif self.num_ended == self.num_consumers:
            self.final = self.high


class EqualGroups:
    """Every iteration's equal split (volatile: see the module docstring)."""

    def __init__(self) -> None:
        self.groups: dict[int, EqualGroup] = {}
        #: ``{iteration client: iteration}`` of the members.
        self.member_of: dict[int, int] = {}
        #: Iterations whose group's answer changed since :meth:`take_changed` (the plugin
        #: wakes the requests parked on them).
        self.changed: set[int] = set()

    def take_changed(self) -> set[int]:
        changed, self.changed = self.changed, set()
        return changed

    def report(self, iteration_id: int, label: str, client_id: int, index: int,
               num_consumers: int, remainder: str, received: int, ended: bool,
               now: float) -> EqualGroup:
        """A consumer's report (see :meth:`EqualGroup.report`); returns its group."""
        if remainder not in REMAINDERS:
            raise ValueError(f"equal must be one of {REMAINDERS}, got {remainder!r}")
        if isinstance(num_consumers, bool) or not isinstance(num_consumers, int) \
                or num_consumers < 1:
            raise ValueError(f"num_consumers must be a positive int, got {num_consumers!r}")
        group = self.groups.get(iteration_id)
        if group is None:
            group = self.groups[iteration_id] = EqualGroup(num_consumers, remainder, now, label)
        version = group.version
        group.report(index, client_id, num_consumers, remainder, int(received), bool(ended))
        self.member_of[client_id] = iteration_id
        if group.version != version:
            self.changed.add(iteration_id)
        return group

    def get(self, iteration_id: int) -> EqualGroup | None:
        return self.groups.get(iteration_id)

    def left(self, client_id: int) -> EqualGroup | None:
        """Iteration client ``client_id`` was released; returns its group if it had one."""
        iteration_id = self.member_of.pop(client_id, None)
        group = None if iteration_id is None else self.groups.get(iteration_id)
        if group is not None:
            version = group.version
            group.left(client_id)
            if group.version != version:
                self.changed.add(iteration_id)  # type: ignore[arg-type]  # not None here
            if not any(c in self.member_of for c in group.clients if c is not None):
                del self.groups[iteration_id]  # type: ignore[arg-type]  # not None here
                self.changed.add(iteration_id)  # type: ignore[arg-type]  # its waiters go
        return group

    def tick(self, now: float, timeout: float) -> None:
        """Check every group's joining deadline (one GC round: O(groups))."""
        for iteration_id, group in self.groups.items():
            version = group.version
            group.tick(now, timeout)
            if group.version != version:
                self.changed.add(iteration_id)


def equal_sync(core: DispatcherCore, iteration_client_id: int, now: float,
               job_token: str | None, consumer_index: int, num_consumers: int, remainder: str,
               received: int, ended: bool = False) -> EqualGroup:
    """The stimulus ``DispatcherCore.equal_sync``: a consumer of an equal split reports what
    it holds; it is alive, as for a heartbeat. Returns its group (the shell answers
    ``group.answer()``, maybe after waiting for it to change)."""
    client = core._iteration_client(iteration_client_id, job_token, "an equal split")
    core.client_seen.seen(iteration_client_id, int(now * 1_000_000))
    iteration = core.state.iteration(client.iteration_id)
    job = core.state.job(iteration.job_id)
    if job.processing_mode != "DYNAMIC":
        raise ValueError(f"equal splits need a DYNAMIC job, not {job.processing_mode}")
    name = (job.job_name or "").split("#equal", 1)[0]
    label = f"job {name!r} (dataset {job.dataset_id}, pass {iteration.repetition})"
    return core.equal.report(client.iteration_id, label, iteration_client_id, consumer_index,
                             num_consumers, remainder, received, ended, now)
