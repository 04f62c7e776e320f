"""Equal splits without a cluster: the dispatcher's rules (service/dispatcher/_equal.py), the
consumer's gate (service/client/equal_core.py), both through DispatcherCore, and a seeded
simulation of N consumers with bounded buffers sharing one pool of elements that checks
equal counts, at most once, the drop bound and progress (no deadlock) for every seed."""

from __future__ import annotations

import random

import pytest
from test_dispatcher_core import dataset, make, read

from dask_dataservice.errors import DataServiceError
from dask_dataservice.service.client.equal_core import EqualGate, take
from dask_dataservice.service.dispatcher._equal import EqualGroup, EqualGroups

pytestmark = [pytest.mark.pure, pytest.mark.timeout(60)]


def group(n=2, remainder="drop") -> EqualGroup:
    return EqualGroup(n, remainder, created=0.0, label="job 'j'")


def test_nothing_is_allowed_until_every_consumer_joined():
    g = group(3)
    g.report(0, 10, 3, "drop", 50, False)
    g.report(1, 11, 3, "drop", 40, False)
    assert g.allowed == 0 and g.waits(1)
    g.report(2, 12, 3, "drop", 45, False)
    assert g.allowed == 40  # the least any consumer holds
    assert not g.waits(40) and g.waits(41)


def test_the_running_min_follows_the_slowest():
    g = group(2)
    g.report(0, 10, 2, "drop", 5, False)
    g.report(1, 11, 2, "drop", 5, False)
    assert (g.low, g.at_low) == (5, 2)
    g.report(0, 10, 2, "drop", 9, False)
    assert g.allowed == 5  # consumer 1 still holds 5
    g.report(1, 11, 2, "drop", 20, False)
    assert g.allowed == 9
    g.report(1, 11, 2, "drop", 3, False)  # an older report arriving late changes nothing
    assert g.allowed == 9


def test_drop_decides_once_an_ended_consumer_holds_the_minimum():
    g = group(2)
    g.report(0, 10, 2, "drop", 30, False)
    g.report(1, 11, 2, "drop", 24, False)
    g.report(0, 10, 2, "drop", 30, True)  # ended, but above the minimum: 1 may still get more
    assert g.final is None
    g.report(1, 11, 2, "drop", 27, True)
    assert g.final == 27 and g.allowed == 27
    assert g.answer() == {"status": "OK", "allowed": 27, "final": 27, "version": g.version}


def test_drop_ends_without_waiting_for_a_consumer_blocked_with_more():
    # consumer 0 holds more than it may deliver and cannot see its end (its buffer is full)
    g = group(2)
    g.report(0, 10, 2, "drop", 40, False)
    g.report(1, 11, 2, "drop", 33, True)
    assert g.final == 33


def test_pad_unbounds_once_a_pass_ended_and_decides_the_most_at_the_end():
    g = group(3, "pad")
    for i, n in enumerate((10, 12, 11)):
        g.report(i, 10 + i, 3, "pad", n, False)
    assert g.allowed == 10
    g.report(0, 10, 3, "pad", 10, True)
    assert g.allowed is None and g.final is None  # the others go on: 0 will pad
    g.report(1, 11, 3, "pad", 15, True)
    g.report(2, 12, 3, "pad", 14, True)
    assert g.final == 15


@pytest.mark.parametrize("report, message", [
    ((1, 11, 3, "drop", 1, False), "consumer_index=1 reads job 'j' with num_consumers=3, but "
     "its other consumers use num_consumers=2"),
    ((1, 11, 2, "pad", 1, False), "consumer_index=1 reads job 'j' with equal='pad', but its "
     "other consumers use equal='drop'"),
    ((0, 99, 2, "drop", 1, False), "consumer_index=0 of job 'j' is already read by another "
     "consumer"),
    ((2, 12, 2, "drop", 1, False), "need 0 <= consumer_index < num_consumers, got "
     "consumer_index=2, num_consumers=2"),
])
def test_consumers_that_disagree_are_refused(report, message):
    g = group(2)
    g.report(0, 10, 2, "drop", 1, False)
    with pytest.raises(ValueError, match=message):
        g.report(*report)
    assert g.clients == [10, None] and g.failed is None  # nothing changed


def test_a_member_leaving_early_fails_the_group_and_a_late_one_does_not():
    g = group(2)
    g.report(0, 10, 2, "drop", 5, False)
    g.report(1, 11, 2, "drop", 5, False)
    g.left(11)
    with pytest.raises(DataServiceError, match="the equal split failed: consumer 1 of the 2 "
                       "consumers of job 'j' stopped reading before the equal count was decided"):
        g.answer()
    done = group(2)
    done.report(0, 10, 2, "drop", 5, True)
    done.report(1, 11, 2, "drop", 5, True)
    done.left(10)  # after the count was decided: fine
    assert done.answer()["final"] == 5


def test_a_consumer_that_never_joins_fails_the_group_after_the_timeout():
    g = group(3)
    g.report(0, 10, 3, "drop", 5, False)
    g.tick(now=29.0, timeout=30.0)
    assert g.failed is None
    g.tick(now=31.0, timeout=30.0)
    with pytest.raises(DataServiceError, match=r"consumer_index 1, 2 of job 'j' \(num_consumers=3\)"
                       " never joined within dataservice.dispatcher.client-timeout=30s"):
        g.answer()


def test_bad_settings_are_refused_before_a_group_exists():
    groups = EqualGroups()
    with pytest.raises(ValueError, match="equal must be one of"):
        groups.report(1, "j", 10, 0, 2, "sometimes", 0, False, 0.0)
    with pytest.raises(ValueError, match="num_consumers must be a positive int"):
        groups.report(1, "j", 10, 0, 0, "drop", 0, False, 0.0)
    assert not groups.groups


def test_through_the_core_a_silent_consumer_is_released_and_fails_the_split():
    core, _ = make(client_timeout=30.0)
    ds = dataset(core)
    views = [read(core, ds, "DYNAMIC", job_name="train#equal") for _ in range(2)]
    token = core.state.job(core.state.iteration(views[0]["iteration_id"]).job_id).token
    c0, c1 = (v["iteration_client_id"] for v in views)
    g = core.equal_sync(c0, 100.0, token, 0, 2, "drop", 16).reply
    core.equal_sync(c1, 100.0, token, 1, 2, "drop", 8)
    assert g.allowed == 8
    assert core.equal.take_changed() == {views[0]["iteration_id"]}  # the plugin wakes waiters
    core.equal_sync(c0, 125.0, token, 0, 2, "drop", 16)  # 0 stays alive, 1 goes silent
    core.gc_tick(131.0)
    with pytest.raises(DataServiceError, match="consumer 1 of the 2 consumers of job 'train' "
                       r"\(dataset .*, pass 0\) stopped reading"):
        g.answer()


def test_through_the_core_equal_needs_a_dynamic_job():
    core, _ = make()
    ds = dataset(core)
    view = read(core, ds, "OFF", job_name="j")
    token = core.state.job(core.state.iteration(view["iteration_id"]).job_id).token
    with pytest.raises(ValueError, match="equal splits need a DYNAMIC job, not OFF"):
        core.equal_sync(view["iteration_client_id"], 100.0, token, 0, 2, "drop", 0)


def test_the_gate():
    gate = EqualGate("drop")
    gate.got(10)
    assert gate.may_move() == 0 and gate.waiting(10) and gate.unreported
    assert gate.report().need == 1 and not gate.unreported
    gate.on_reply({"allowed": 6, "final": None})
    gate.on_reply({"allowed": 4, "final": None})  # out of order: the most counts
    assert gate.may_move() == 6
    assert take(list(range(10)), 6) == (list(range(6)), list(range(6, 10)))
    gate.moved_out(6)
    gate.on_reply({"allowed": 8, "final": 8})
    gate.moved_out(2)
    assert gate.done(2) and gate.pad_count() == 0
    pad = EqualGate("pad")
    pad.got(3)
    pad.on_reply({"allowed": None, "final": None})
    assert pad.may_move() is None
    pad.moved_out(3)
    pad.end()
    assert pad.waiting(0)
    pad.on_reply({"allowed": 7, "final": 7})
    assert pad.done(0) and pad.pad_count() == 4


def simulate(seed: int, n: int, remainder: str, total: int, held_cap: int, chunk: int):
    """N consumers share a pool of ``total`` elements in chunks (first come, first served),
    each holding at most ``held_cap`` elements it may not deliver yet; every step one
    consumer, drawn with its own speed, fetches, reports, or delivers. Returns what each
    delivered."""
    rng = random.Random(seed)
    speeds = [rng.uniform(0.2, 1.0) for _ in range(n)]
    g = EqualGroup(n, remainder, 0.0, "job 'sim'")
    gates = [EqualGate(remainder) for _ in range(n)]
    held: list[list[int]] = [[] for _ in range(n)]
    delivered: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    pool = list(range(total))
    rng.shuffle(pool)
    for _step in range(200_000):
        if all(done):
            break
        i = rng.choices(range(n), weights=speeds)[0]
        gate = gates[i]
        if done[i]:
            continue
        action = rng.random()
        if action < 0.4 and not gate.ended and len(held[i]) < held_cap:
            if pool:
                got = [pool.pop() for _ in range(min(chunk, len(pool)))]
                held[i] += got
                gate.got(len(got))
            else:
                gate.end()
        elif action < 0.7 or gate.waiting(len(held[i])):
            r = gate.report()
            g.report(i, 100 + i, n, remainder, r.received, r.ended)
            gate.on_reply(g.answer())
        limit = gate.may_move()
        part, held[i] = take(held[i], limit)
        gate.moved_out(len(part))
        delivered[i] += part
        if gate.done(len(held[i])):
            pads = gate.pad_count()
            assert pads == 0 or delivered[i], "nothing to pad with"
            delivered[i] += [delivered[i][k % len(delivered[i])] for k in range(pads)]
            gate.moved_out(pads)
            done[i] = True
    else:
        raise AssertionError(f"seed {seed}: no progress (a deadlock) after 200,000 steps")
    assert all(done), f"seed {seed}: consumers {done} never finished"
    return delivered


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_seeded_simulation_equal_counts_at_most_once_bounded_drop(remainder):
    for seed in range(300):
        rng = random.Random(seed)
        n = rng.randint(2, 5)
        held_cap, chunk = rng.randint(1, 32), rng.randint(1, 16)
        # pad needs something to repeat: more than the others can hold before one has any
        total = rng.randint(n * (held_cap + chunk) if remainder == "pad" else 0, 400 + 200 * n)
        delivered = simulate(seed, n, remainder, total, held_cap, chunk)
        counts = {len(d) for d in delivered}
        assert len(counts) == 1, f"seed {seed}: counts {[len(d) for d in delivered]}"
        if remainder == "drop":
            union = [x for d in delivered for x in d]
            assert len(union) == len(set(union)), f"seed {seed}: an element twice"
            # the drop: at most what each consumer but one held beyond the others
            assert total - len(union) <= (n - 1) * (held_cap + chunk - 1), f"seed {seed}"
        else:
            firsts = [x for d in delivered for x in dict.fromkeys(d)]
            assert sorted(firsts) == list(range(total)), f"seed {seed}: pad lost elements"


def test_the_simulation_catches_a_count_decided_too_early(monkeypatch):
    """The checker is not vacuous: deciding ``drop``'s count as soon as any consumer ended
    (not only one holding the minimum) is caught (the others deliver fewer)."""
    def premature(self):
        if self.final is None and self.joined == self.num_consumers and self.ended_low is not None:
            self.final = self.low

    monkeypatch.setattr(EqualGroup, "_decide", premature)
    with pytest.raises(AssertionError, match="seed"):
        test_seeded_simulation_equal_counts_at_most_once_bounded_drop("drop")


def test_the_gate_reports_at_once_only_what_others_may_wait_for():
    gate = EqualGate("drop")
    gate.got(8)
    assert gate.urgent  # never reported
    gate.report()
    gate.on_reply({"allowed": 4, "final": None})  # the others hold 4: nobody waits for 8
    gate.got(8)
    assert gate.unreported and not gate.urgent
    gate.report()
    gate.on_reply({"allowed": 16, "final": None})  # it holds the least: the others wait for it
    gate.got(8)
    assert gate.urgent
    gate.report()
    gate.end()
    assert gate.urgent  # the end is always news
    gate.report()
    gate.on_reply({"allowed": 24, "final": 24})
    gate.got(1)
    assert not gate.unreported  # decided: nothing more to say
