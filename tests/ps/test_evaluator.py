"""SidecarEvaluator: sees every checkpoint training writes, stops after the final one."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import textwrap
import threading

import pytest

import dask_dataservice as dds
from dask_dataservice.ps.callbacks import ModelCheckpoint
from dask_dataservice.ps.evaluator import SidecarEvaluator, read_metrics
from dask_dataservice.ps.fit import fit
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.pure, pytest.mark.timeout(60)]

warm_up_zarr()

from _helpers import PS, WK, in_thread  # noqa: E402
from test_callbacks import _step, _strategy_and_counter  # noqa: E402


def _evaluator(directory, **kwargs):
    counter = dds.Variable(0, dtype="i8", name="counter")  # local: no strategy scope
    assert counter.ps_address is None

    def eval_fn(batch):
        return {"counter": int(counter.numpy()), "x": batch}

    return SidecarEvaluator(dds.Checkpoint(counter=counter), eval_fn, lambda: iter([1, 2, 3]),
                            directory, steps=2, poll_interval=0.02, **kwargs)


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, WK])
async def test_sidecar_evaluator_sees_every_checkpoint(s, p0, w0):
    directory = tempfile.mkdtemp()
    metrics = os.path.join(directory, "eval.jsonl")
    evaluator = _evaluator(directory, metrics_file=metrics, timeout=30)
    outcome: list = []

    def run_evaluator():
        try:
            outcome.append(evaluator.start())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            outcome.append(e)

    def body(c):
        strategy, counter = _strategy_and_counter(c)

        thread = threading.Thread(target=run_evaluator, name="test-sidecar-evaluator")
        thread.start()
        try:
            fit(strategy, _step(counter), lambda: dds.Dataset.range(3).repeat(), epochs=2,
                steps_per_epoch=5, callbacks=[ModelCheckpoint(dds.Checkpoint(counter=counter),
                                                              directory, save_freq=3)],
                verbose=False)
        finally:
            thread.join(40)
        assert not thread.is_alive()

    try:
        await in_thread(s, body)
        [results] = outcome
        expected = [{"checkpoint": f"ckpt-{n}", "save_counter": n, "counter": 3 * n, "x": 1.5}
                    for n in (1, 2, 3)]
        assert results == expected  # every checkpoint, in order, then it stopped
        assert read_metrics(metrics) == expected
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_sidecar_evaluator_stops_on_timeout_and_checks_arguments():
    directory = tempfile.mkdtemp()
    try:
        with pytest.raises(TimeoutError, match="no new checkpoint .* for 0.1 s"):
            _evaluator(directory, timeout=0.1).start()
        with pytest.raises(ValueError, match="steps must be a positive integer"):
            SidecarEvaluator(dds.Checkpoint(), print, [], directory, steps=0)
        with pytest.raises(TypeError, match="checkpoint must be a dds.Checkpoint"):
            SidecarEvaluator(None, print, [], directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


_EVALUATOR = textwrap.dedent("""
    import json, sys
    import dask_dataservice as dds

    directory, metrics = sys.argv[1:3]
    counter = dds.Variable(0, dtype="i8", name="counter")
    evaluator = dds.SidecarEvaluator(
        dds.Checkpoint(counter=counter), lambda batch: {"counter": int(counter.numpy())},
        [0], directory, metrics_file=metrics, poll_interval=0.02, timeout=50)
    print(json.dumps([r["checkpoint"] for r in evaluator.start()]))
""")


@pytest.mark.process
@pytest.mark.slow
@gen_cluster(client=False, nthreads=[PS, WK], timeout=80)
async def test_sidecar_evaluator_in_its_own_process(s, p0, w0):
    directory = tempfile.mkdtemp()
    metrics = os.path.join(directory, "eval.jsonl")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _EVALUATOR, directory, metrics,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)

        def body(c):
            strategy = dds.ParameterServerStrategy(c)
            with strategy.scope():
                counter = dds.Variable(0, dtype="i8", name="counter")
            fit(strategy, _step(counter), lambda: dds.Dataset.range(3).repeat(), epochs=4,
                steps_per_epoch=3, callbacks=[ModelCheckpoint(dds.Checkpoint(counter=counter),
                                                              directory)], verbose=False)

        await in_thread(s, body)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()[-2000:]
        assert json.loads(out.decode().strip().splitlines()[-1]) == [
            "ckpt-1", "ckpt-2", "ckpt-3", "ckpt-4"]
        assert [r["counter"] for r in read_metrics(metrics)] == [3, 6, 9, 12]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
