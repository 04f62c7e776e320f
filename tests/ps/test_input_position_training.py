"""The issue's test for data-service inputs (issue 13, section 2): train with the
coordinator, back up at step 4, SIGKILL every server process at step 6 (scheduler, parameter
server, training workers, which are also the data workers), start them again with the same
names, restore, finish: every example is trained on exactly as often as one epoch says
(DYNAMIC: once; OFF: once per data worker)."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
import zarr

import dask_dataservice as dds

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

from test_input_position import (  # noqa: E402
    _KillEveryServer,
    _process_cluster,
    _train,
)


def _service_dataset_fn(mode: str, size: int, batch: int, track: bool = True,
                        job_name: str | None = "train"):
    def dataset_fn():
        from distributed import get_worker

        address = get_worker().scheduler.address
        ds = dds.Dataset.range(size).map(lambda x: x).batch(batch)
        return ds.apply(dds.distribute(mode, address, job_name=job_name, split_size=8,
                                       track_position=track))

    return dataset_fn


mode_policy = {"distributed_epoch": "DYNAMIC", "parallel_epochs": "OFF"}


def _saved_inputs(directory):
    return dict(zarr.open_group(os.path.join(directory, "backup-1"), mode="r").attrs)["inputs"]


def _sigkill_two_lives(mode, forget_position=False, job_name="train"):
    """Two data workers (the training worker and one more; a PS serves no data). Returns
    the examples' counts after the second life, the restored state and the saved inputs."""
    size, batch = 40, 4
    copies = 1 if mode == "distributed_epoch" else 2  # OFF: each data worker, one epoch
    steps, trainers, data_workers = copies * size // batch, 1, 1
    directory = tempfile.mkdtemp()
    backup = os.path.join(directory, "backup")
    dataset_fn = _service_dataset_fn(mode, size, batch, job_name=job_name)
    try:
        with _process_cluster(directory, trainers, data_workers) as (address, pids):
            _KillEveryServer.pids = pids
            seen, restored = _train(address, backup, dataset_fn, size, steps, 6,
                                    _KillEveryServer, workers=trainers + data_workers + 1)
            assert seen is None and restored is None
        saved = _saved_inputs(backup)
        if forget_position:  # as if restoring ignored it: the position of nothing read
            group = zarr.open_group(os.path.join(backup, "backup-1"), mode="r+")
            attrs = dict(group.attrs)
            for p in attrs["inputs"]["input"].values():
                p.update(done=[], partial={})
            group.attrs.put(attrs)
        with _process_cluster(directory, trainers, data_workers) as (address, _):
            seen, restored = _train(address, backup, dataset_fn, size, steps, None,
                                    workers=trainers + data_workers + 1)
        return seen, restored, saved, copies
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode, job_name", [("distributed_epoch", "train"),
                                            ("parallel_epochs", "train"),
                                            ("distributed_epoch", None)])
def test_one_epoch_exactly_after_sigkilling_every_process(mode, job_name):
    """DYNAMIC reads the epoch once between the two data workers, OFF once per data
    worker: after the restart, each example exactly that often. A private job (no
    job_name) resumes from the training worker's own position."""
    seen, restored, saved, copies = _sigkill_two_lives(mode, job_name=job_name)
    assert {p["policy"] for p in saved["input"].values()} == {mode_policy[mode]}
    assert restored["global_step"] == 4
    np.testing.assert_array_equal(seen, np.full(40, copies, "i8"))


@pytest.mark.slow
def test_the_test_fails_when_the_position_is_ignored():
    """Restoring from an empty position instead trains on the examples of the first four
    steps twice: what the test above checks is not true by accident."""
    seen, restored, _, _ = _sigkill_two_lives("distributed_epoch", forget_position=True)
    assert restored["global_step"] == 4
    assert seen.sum() == 40 and seen.max() == 2  # some examples twice (so others never)
