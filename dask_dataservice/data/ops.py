"""Transformations: ops with one or more input ops.

Each op validates its arguments in ``__init__`` (so a bad argument fails where the pipeline
is defined, naming the argument) and returns a generator from :meth:`iterate`. User
functions are called with the element unpacked when it is a tuple (``fn(*x)``), otherwise
with the element itself, as in tf.data. An exception raised by a user function keeps its
type and traceback and gains a note naming the op and the element.
"""

from __future__ import annotations

import functools
import itertools
import random
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from ._base import (
    _NO_ELEMENT,
    AUTOTUNE,
    INFINITE,
    UNKNOWN,
    IterContext,
    Op,
    annotate_user_error,
    autotune_threads,
)
from .splits import SHARD_HINT, _ShardHint
from .structure import pad_stack, stack, unstack

# ----------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------


def check_int(name: str, value: Any, *, minimum: int | None = None,
              allow: tuple[Any, ...] = ()) -> int:
    if value in allow and not isinstance(value, bool):
        return value  # type: ignore[no-any-return]  # an allowed marker (AUTOTUNE...)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r:.40}")
    number = int(value)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def check_callable(name: str, fn: Any) -> Callable[..., Any]:
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__} {fn!r:.40}")
    return fn  # type: ignore[no-any-return]


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r:.40}")
    return bool(value)


def check_deterministic(value: Any) -> bool:
    """``deterministic``: None (the default, True) or a bool."""
    if value is None:
        return True
    return check_bool("deterministic", value)


def parallelism(name: str, value: Any) -> int | None:
    """None (sequential), a positive int, or AUTOTUNE → a thread count."""
    if value is None:
        return None
    if value == AUTOTUNE and not isinstance(value, bool):
        return autotune_threads()
    return check_int(name, value, minimum=1)


def call(fn: Callable[..., Any], x: Any) -> Any:
    """Call a user function the tf.data way: tuples are unpacked into arguments."""
    if type(x) is tuple:
        return fn(*x)
    return fn(x)


def _call_annotated(fn: Callable[..., Any], x: Any, op: str) -> Any:
    try:
        return fn(*x) if type(x) is tuple else fn(x)
    except Exception as e:
        annotate_user_error(e, op, fn, x)
        raise


#: What ``_call_dropping`` returns for an element ``ignore_errors()`` drops.
_DROPPED = object()


def _call_dropping(ctx: IterContext, fn: Callable[..., Any], x: Any, op: str) -> Any:
    try:
        return fn(*x) if type(x) is tuple else fn(x)
    except Exception as e:
        if ctx.ignored(e):
            return _DROPPED
        annotate_user_error(e, op, fn, x)
        raise


def _close(it: Any) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()


# ----------------------------------------------------------------------------------------
# background threads: prefetch and parallel interleave
# ----------------------------------------------------------------------------------------

class ThreadedIterator:
    """Runs ``make_iter()`` in a daemon thread that stays up to ``buffer_size`` elements ahead.

    The producer appends each element to a bounded deque under a condition variable (so an
    element is available to the consumer as soon as it exists); the consumer takes the
    whole deque at once when its own is empty, so it pays one lock round-trip per batch.
    Each side signals the other only when it is waiting. At most ``2 * buffer_size``
    elements are held (the producer's deque and the consumer's). :meth:`close` stops the
    thread promptly (a producer blocked on a full buffer wakes up at once), even when the
    consumer abandons the iterator; the producer closes its own input iterator when it
    exits.
    """

    def __init__(self, make_iter: Callable[[], Iterator[Any]] | None, buffer_size: int,
                 name: str) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._buf: deque[Any] = deque()  # filled by the producer, under the lock
        self._pending: deque[Any] = deque()  # taken by the consumer, touched by it alone
        self._cap = max(1, buffer_size)
        self._make_iter = make_iter
        self._stopped = False  # the consumer closed the iterator
        self._finished = False  # the producer ended (input exhausted, failed or stopped)
        self._failure: BaseException | None = None
        self._waiting = 0  # threads blocked in cv.wait()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        it = None
        cv, cap = self._cv, self._cap
        try:
            assert self._make_iter is not None  # dropped only when this thread ends
            it = self._make_iter()
            for x in it:
                with cv:
                    while len(self._buf) >= cap and not self._stopped:
                        self._waiting += 1
                        cv.wait()
                        self._waiting -= 1
                    if self._stopped:
                        return
                    self._buf.append(x)
                    if self._waiting:
                        cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            with cv:
                self._failure = e
        finally:
            with cv:
                self._finished = True
                cv.notify_all()
            self._make_iter = None
            if it is not None:
                try:
                    _close(it)
                except Exception:  # noqa: BLE001 - closing an abandoned input
                    pass

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._pending:
            return self._pending.popleft()
        cv = self._cv
        with cv:
            while not self._buf and not self._finished and not self._stopped:
                self._waiting += 1
                cv.wait()
                self._waiting -= 1
            if self._buf:
                # Take everything buffered at once: one lock round-trip per batch, not per
                # element, and the producer gets the whole buffer back to fill.
                self._pending, self._buf = self._buf, self._pending
                if self._waiting:
                    cv.notify_all()
                return self._pending.popleft()
            exc, self._failure = self._failure, None
            self._stopped = True
        if exc is not None:
            raise exc
        raise StopIteration

    def fill(self) -> tuple[int, int]:
        """(elements ready for the consumer, the most it holds): ``Dataset.stats()``."""
        return len(self._buf) + len(self._pending), 2 * self._cap

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._buf.clear()
            self._cv.notify_all()
        self._pending.clear()

    def __del__(self) -> None:
        self._stopped = True


def _threaded(make_iter: Callable[[], Iterator[Any]], buffer_size: int, name: str,
              watch: Callable[[Callable[[], tuple[int, int]]], None] | None = None) -> Iterator[Any]:
    """A generator over a :class:`ThreadedIterator` that stops the thread when closed
    (``watch(fill)`` is given the buffer's fill, for the iteration's figures)."""
    ti = ThreadedIterator(make_iter, buffer_size, name)
    if watch is not None:
        watch(ti.fill)
    try:
        yield from ti
    finally:
        ti.close()


# ----------------------------------------------------------------------------------------
# ops
# ----------------------------------------------------------------------------------------


class Unary(Op):
    def __init__(self, input: Op) -> None:
        self.input = input
        self.inputs = (input,)

    def cardinality(self) -> int:
        return self.input.cardinality()


class Map(Unary):
    name = "map"

    def __init__(self, input: Op, fn: Callable[..., Any], num_parallel_calls: int | None = None,
                 deterministic: bool | None = True) -> None:
        super().__init__(input)
        self.fn = check_callable("map_func", fn)
        self.num_parallel_calls = parallelism("num_parallel_calls", num_parallel_calls)
        # As given (AUTOTUNE stays AUTOTUNE), so the fingerprint does not depend on the CPUs.
        self._num_parallel_calls_arg = None if num_parallel_calls is None else int(num_parallel_calls)
        self.deterministic = check_deterministic(deterministic)

    def params(self) -> tuple[Any, ...]:
        return (self.fn, self._num_parallel_calls_arg, self.deterministic)

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        it = self.input.iterate(ctx)
        if self.num_parallel_calls and self.num_parallel_calls > 1:
            return self._parallel(it, ctx)
        return self._sequential(it, ctx)

    def _sequential(self, it: Iterator[Any], ctx: IterContext) -> Iterator[Any]:
        fn = self.fn
        for x in it:
            try:
                y = fn(*x) if type(x) is tuple else fn(x)
            except Exception as e:
                if ctx.ignored(e):
                    continue
                annotate_user_error(e, "map", fn, x)
                raise
            yield y

    def _parallel(self, it: Iterator[Any], ctx: IterContext) -> Iterator[Any]:
        results = self._parallel_results(it, ctx)
        if not ctx.ignore_errors:
            return results
        return (y for y in results if y is not _DROPPED)

    def _parallel_results(self, it: Iterator[Any], ctx: IterContext) -> Iterator[Any]:
        call = _call_annotated if not ctx.ignore_errors else functools.partial(_call_dropping, ctx)
        n = self.num_parallel_calls
        assert n is not None  # the parallel path
        pool = ThreadPoolExecutor(n, thread_name_prefix="dds-map")
        pending: deque[Any] = deque()
        running: set[Any] = set()
        in_flight = 2 * n
        if ctx.stats is not None:  # calls in flight, of the most there are
            ctx.stats.watch_buffer(self, lambda: (len(pending) + len(running), in_flight))
        try:
            if self.deterministic:
                for x in it:
                    pending.append(pool.submit(call, self.fn, x, "map"))
                    if len(pending) >= in_flight:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            else:
                for x in it:
                    running.add(pool.submit(call, self.fn, x, "map"))
                    if len(running) >= in_flight:
                        done, running = wait(running, return_when=FIRST_COMPLETED)
                        for f in done:
                            yield f.result()
                while running:
                    done, running = wait(running, return_when=FIRST_COMPLETED)
                    for f in done:
                        yield f.result()
        finally:
            for f in pending:
                f.cancel()
            pool.shutdown(wait=False, cancel_futures=True)
            _close(it)


class Filter(Unary):
    name = "filter"

    def __init__(self, input: Op, predicate: Callable[..., Any]) -> None:
        super().__init__(input)
        self.predicate = check_callable("predicate", predicate)

    def params(self) -> tuple[Any, ...]:
        return (self.predicate,)

    def cardinality(self) -> int:
        n = self.input.cardinality()
        return n if n == INFINITE else UNKNOWN

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        pred = self.predicate
        for x in self.input.iterate(ctx):
            try:
                keep = pred(*x) if type(x) is tuple else pred(x)
            except Exception as e:
                if ctx.ignored(e):
                    continue
                annotate_user_error(e, "filter", pred, x)
                raise
            if keep:
                yield x


class Batch(Unary):
    name = "batch"

    def __init__(self, input: Op, batch_size: int, drop_remainder: bool=False) -> None:
        super().__init__(input)
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.drop_remainder = check_bool("drop_remainder", drop_remainder)

    def params(self) -> tuple[Any, ...]:
        return (self.batch_size, self.drop_remainder)

    def cardinality(self) -> int:
        n = self.input.cardinality()
        if n < 0:
            return n
        return n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)

    def _stack(self, items: list[Any]) -> Any:
        try:
            return stack(items)
        except ValueError as e:
            annotate_user_error(e, self.name, None, _NO_ELEMENT)
            raise

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        it = self.input.iterate(ctx)
        n = self.batch_size
        islice = itertools.islice
        while True:
            items = list(islice(it, n))
            if not items or (len(items) < n and self.drop_remainder):
                return
            yield self._stack(items)
            if len(items) < n:
                return


class PaddedBatch(Batch):
    name = "padded_batch"

    def __init__(self, input: Op, batch_size: int, padded_shapes: Any = None,
                 padding_values: Any = None, drop_remainder: bool = False) -> None:
        super().__init__(input, batch_size, drop_remainder)
        self.padded_shapes = padded_shapes
        self.padding_values = padding_values

    def params(self) -> tuple[Any, ...]:
        return (self.batch_size, self.padded_shapes, self.padding_values, self.drop_remainder)

    def _stack(self, items: list[Any]) -> Any:
        try:
            return pad_stack(items, self.padded_shapes, self.padding_values)
        except (ValueError, TypeError, KeyError) as e:
            annotate_user_error(e, self.name, None, _NO_ELEMENT)
            raise


class Unbatch(Unary):
    name = "unbatch"

    def cardinality(self) -> int:
        n = self.input.cardinality()
        return n if n == INFINITE else UNKNOWN

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        for x in self.input.iterate(ctx):
            if isinstance(x, np.ndarray):
                if x.ndim == 0:
                    raise ValueError("unbatch() needs elements with a leading axis, got a scalar")
                yield from x
            else:
                yield from unstack(x)


class Shuffle(Unary):
    name = "shuffle"

    def __init__(self, input: Op, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool=True) -> None:
        super().__init__(input)
        self.buffer_size = check_int("buffer_size", buffer_size, minimum=1)
        self.seed = None if seed is None else check_int("seed", seed)
        self.reshuffle = check_bool("reshuffle_each_iteration", reshuffle_each_iteration)
        # An unseeded shuffle that must repeat its order picks its seed once, here.
        self._fixed_seed = self.seed if self.seed is not None else random.getrandbits(63)

    def params(self) -> tuple[Any, ...]:
        return (self.buffer_size, self.seed, self.reshuffle)

    def _rng(self, ctx: IterContext) -> random.Random:
        epoch = ctx.next_epoch(self)
        if not self.reshuffle:
            return random.Random(self._fixed_seed)
        if self.seed is None:
            return random.Random()
        return random.Random(self.seed * 1_000_003 + epoch)

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        rng = self._rng(ctx)
        randrange = rng.randrange
        buf: list[Any] = []
        size = self.buffer_size
        it = self.input.iterate(ctx)
        for x in it:
            if len(buf) < size:
                buf.append(x)
                continue
            j = randrange(size)
            out, buf[j] = buf[j], x
            yield out
        rng.shuffle(buf)
        yield from buf


class Repeat(Unary):
    name = "repeat"

    def __init__(self, input: Op, count: int | None = None) -> None:
        super().__init__(input)
        if count is not None and count != -1:
            count = check_int("count", count, minimum=0)
        self.count = None if count in (None, -1) else count

    def params(self) -> tuple[Any, ...]:
        return (self.count,)

    def cardinality(self) -> int:
        n = self.input.cardinality()
        if self.count == 0:
            return 0
        if self.count is None:
            return 0 if n == 0 else INFINITE
        if n < 0:
            return n
        return n * self.count

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        provider = ctx.split_provider
        done = 0
        while self.count is None or done < self.count:
            if done and provider is not None:
                provider.reset()
            produced = False
            for x in self.input.iterate(ctx):
                produced = True
                yield x
            done += 1
            if not produced and self.count is None:
                # An empty input would make an infinite repeat spin forever. Under a split
                # provider a repetition may be empty for this worker only (others took
                # every split), so stop only when the source has no splits at all, or none
                # will come to this worker any more (it is drained before it retires).
                if provider is None or getattr(provider, "num_splits", None) == 0 \
                        or getattr(provider, "drained", False):
                    return


class _Counted(Unary):
    """An op with one ``count`` argument (-1: all)."""

    def __init__(self, input: Op, count: int) -> None:
        super().__init__(input)
        self.count = check_int("count", count, minimum=-1)

    def params(self) -> tuple[Any, ...]:
        return (self.count,)


class Take(_Counted):
    name = "take"

    def cardinality(self) -> int:
        n = self.input.cardinality()
        if self.count == -1:
            return n
        if n == INFINITE:
            return self.count
        return n if n < 0 else min(n, self.count)

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        it = self.input.iterate(ctx)
        if self.count == -1:
            yield from it
            return
        try:
            yield from itertools.islice(it, self.count)
        finally:
            _close(it)


class Skip(_Counted):
    name = "skip"

    def cardinality(self) -> int:
        n = self.input.cardinality()
        if self.count == -1:
            return 0 if n >= 0 else n
        return n if n < 0 else max(0, n - self.count)

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        it = self.input.iterate(ctx)
        if self.count == -1:
            for _ in it:
                pass
            return
        yield from itertools.islice(it, self.count, None)


class Shard(Unary):
    name = "shard"

    def __init__(self, input: Op, num_shards: int | _ShardHint, index: int | _ShardHint) -> None:
        super().__init__(input)
        self.num_shards: int
        self.index: int
        hint_n, hint_i = num_shards is SHARD_HINT, index is SHARD_HINT
        if hint_n != hint_i:
            raise ValueError("shard() takes SHARD_HINT for both num_shards and index, or for neither")
        self.is_hint = hint_n
        if not self.is_hint:
            self.num_shards = check_int("num_shards", num_shards, minimum=1)
            self.index = check_int("index", index, minimum=0)
            if self.index >= self.num_shards:
                raise ValueError(f"index must be < num_shards ({self.num_shards}), got {self.index}")
        else:
            # placeholders: each worker builds its own Shard with (num_workers, worker_index)
            self.num_shards = self.index = SHARD_HINT  # type: ignore[assignment]

    def params(self) -> tuple[Any, ...]:
        return (self.num_shards, self.index)

    def cardinality(self) -> int:
        n = self.input.cardinality()
        if n < 0 or self.is_hint:
            return n if n < 0 else UNKNOWN
        return max(0, -(-(n - self.index) // self.num_shards))

    def split_blocker(self) -> str:
        return (
            f"shard({self.num_shards}, {self.index}) comes after the source, and splits would "
            "be sharded again per split; shard the data with the service's sharding policy "
            "instead, or use shard(SHARD_HINT, SHARD_HINT) with the HINT policy"
        )

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        if self.is_hint:
            raise ValueError(
                "shard(SHARD_HINT, SHARD_HINT) is a placeholder: it is filled in by the data "
                "service's HINT sharding policy. Iterated locally, give real numbers "
                "(or call Dataset.with_shard_hint(num_shards, index))"
            )
        return itertools.islice(self.input.iterate(ctx), self.index, None, self.num_shards)


class Interleave(Unary):
    """tf.data's interleave: ``cycle_length`` slots, ``block_length`` elements per visit.

    The order is tf.data's exactly: a slot whose inner dataset ends is left empty and the
    cycle moves on; an empty slot is refilled from the input when the cycle comes back to
    it. With ``num_parallel_calls`` each open inner dataset is read ahead in its own thread
    (the order is unchanged).
    """

    name = "interleave"

    def __init__(self, input: Op, fn: Callable[..., Any], cycle_length: int | None = None, block_length: int=1, num_parallel_calls: int | None = None,
                 deterministic: bool | None = None) -> None:
        super().__init__(input)
        self.fn = check_callable("map_func", fn)
        # Arguments as given (AUTOTUNE and None stay so), for a machine-independent fingerprint.
        self._args = (cycle_length, block_length, num_parallel_calls)
        if cycle_length is None or (cycle_length == AUTOTUNE and not isinstance(cycle_length, bool)):
            cycle_length = autotune_threads()
        self.cycle_length = check_int("cycle_length", cycle_length, minimum=1)
        self.block_length = check_int("block_length", block_length, minimum=1)
        self.num_parallel_calls = parallelism("num_parallel_calls", num_parallel_calls)
        self.deterministic = check_deterministic(deterministic)

    def params(self) -> tuple[Any, ...]:
        return (self.fn, *self._args, self.deterministic)

    def cardinality(self) -> int:
        return UNKNOWN

    def _open(self, x: Any, ctx: IterContext, parallel: bool) -> Iterator[Any]:
        ds = _call_annotated(self.fn, x, self.name)
        op = getattr(ds, "_op", None)
        if not isinstance(op, Op):
            raise TypeError(
                f"Dataset.{self.name}: map_func must return a Dataset, got {type(ds).__name__}"
            )
        if parallel:  # the thread starts now, so every open slot reads ahead at once
            return ThreadedIterator(lambda: op.iterate(ctx.nested()), 2 * self.block_length,
                                    f"dds-{self.name}")
        return op.iterate(ctx.nested())

    def _open_or_drop(self, x: Any, ctx: IterContext, parallel: bool) -> Iterator[Any] | None:
        try:
            return self._open(x, ctx, parallel)
        except Exception as e:
            if ctx.ignored(e):
                return None
            raise

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        outer = self.input.iterate(ctx)
        parallel = bool(self.num_parallel_calls and self.num_parallel_calls > 1)
        n, block = self.cycle_length, self.block_length
        slots: list[Any] = [None] * n
        num_open = 0
        end_of_input = False
        index = 0  # the slot being read
        taken = 0  # elements taken from it in this visit
        # Parallel: empty slots are refilled at once, in the order they emptied (so that every
        # open slot reads ahead). The sequential cycle refills them in that same order when it
        # comes back to them, so both give the same elements in the same order.
        to_fill = deque(range(n)) if parallel else None
        try:
            while num_open or not end_of_input:
                while to_fill and not end_of_input:
                    try:
                        x = next(outer)
                    except StopIteration:
                        end_of_input = True
                        break
                    inner = self._open_or_drop(x, ctx, parallel)
                    if inner is None:
                        continue
                    slots[to_fill.popleft()] = inner
                    num_open += 1
                inner = slots[index]
                if inner is not None:
                    try:
                        y = next(inner)
                    except Exception as e:  # StopIteration included: the inner dataset ended
                        if not isinstance(e, StopIteration) and not ctx.ignored(e):
                            raise
                        slots[index] = None
                        num_open -= 1
                        _close(inner)
                        if to_fill is not None:
                            to_fill.append(index)
                        index, taken = (index + 1) % n, 0
                        continue
                    taken += 1
                    if taken == block:
                        index, taken = (index + 1) % n, 0
                    yield y
                elif not end_of_input and not parallel:
                    try:
                        x = next(outer)
                    except StopIteration:
                        end_of_input = True
                        continue
                    inner = self._open_or_drop(x, ctx, parallel)
                    if inner is not None:
                        slots[index] = inner
                        num_open += 1
                else:
                    index, taken = (index + 1) % n, 0
        finally:
            for inner in slots:
                if inner is not None:
                    _close(inner)
            _close(outer)


class FlatMap(Interleave):
    name = "flat_map"

    def __init__(self, input: Op, fn: Callable[..., Any]) -> None:
        super().__init__(input, fn, cycle_length=1, block_length=1)

    def params(self) -> tuple[Any, ...]:
        return (self.fn,)


class Prefetch(Unary):
    name = "prefetch"

    def __init__(self, input: Op, buffer_size: int) -> None:
        super().__init__(input)
        if buffer_size == AUTOTUNE and not isinstance(buffer_size, bool):
            buffer_size = 64
        self.buffer_size = check_int("buffer_size", buffer_size, minimum=0)

    def params(self) -> tuple[Any, ...]:
        return (self.buffer_size,)

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        if self.buffer_size == 0:
            return self.input.iterate(ctx)
        return self._prefetched(ctx)

    def _prefetched(self, ctx: IterContext) -> Iterator[Any]:
        # a frame of this op's while its consumer waits on the buffer (Dataset.stats())
        watch = None if ctx.stats is None else functools.partial(ctx.stats.watch_buffer, self)
        yield from _threaded(lambda: self.input.iterate(ctx), self.buffer_size, "dds-prefetch",
                             watch)


class Enumerate(Unary):
    name = "enumerate"

    def __init__(self, input: Op, start: int=0) -> None:
        super().__init__(input)
        self.start = check_int("start", start)

    def params(self) -> tuple[Any, ...]:
        return (self.start,)

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        it = self.input.iterate(ctx)
        try:
            yield from enumerate(it, self.start)
        finally:
            _close(it)  # a plain enumerate() would not close its input when abandoned
