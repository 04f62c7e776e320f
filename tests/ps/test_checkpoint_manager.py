"""CheckpointManager, checkpoints on any fsspec URL and ``optimizer.iterations`` (issue 24 s4).

The manager's bookkeeping runs on local variables (a Checkpoint of them needs no cluster);
the end-to-end tests train on a parameter server and save to ``memory://`` and to an S3
emulator (moto's server, read through s3fs)."""

from __future__ import annotations

import json
import os
import uuid

import fsspec
import numpy as np
import pytest

import dask_dataservice as dds
from dask_dataservice.ps import optimizers
from dask_dataservice.ps.callbacks import latest_checkpoint
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.component, pytest.mark.timeout(120)]

warm_up_zarr()

from _helpers import PS, WK, in_thread, s3_emulator  # noqa: E402


def _exists(path: str) -> bool:
    fs, root = fsspec.core.url_to_fs(path)
    fs.invalidate_cache()
    return bool(fs.exists(f"{root}/zarr.json"))


def _state(directory) -> dict:
    with open(os.path.join(directory, "latest")) as f:
        return json.load(f)


def test_deletion_and_keep_all_across_managers(tmp_path):
    """TF's checkpoint_management_test.py ``CheckpointManagerTest.testDeletion`` and
    ``testKeepAll``: the oldest checkpoints beyond ``max_to_keep`` are deleted; a new manager
    on the directory takes up the managed list (and deletes only at its next save)."""
    d = str(tmp_path)
    ckpt = dds.Checkpoint(w=dds.Variable(np.zeros(3), name="w"))
    manager = dds.CheckpointManager(ckpt, d, max_to_keep=None)
    first, second, third = manager.save(), manager.save(), manager.save()
    assert [first, second, third] == [f"{d}/ckpt-1", f"{d}/ckpt-2", f"{d}/ckpt-3"]
    assert manager.latest_checkpoint == third
    assert manager.checkpoints == [first, second, third]
    fourth = dds.CheckpointManager(ckpt, d, max_to_keep=None).save()
    manager = dds.CheckpointManager(ckpt, d, max_to_keep=3)
    assert manager.checkpoints == [first, second, third, fourth]
    assert all(map(_exists, [first, second, third, fourth]))
    fifth = manager.save()
    assert manager.checkpoints == [third, fourth, fifth]
    assert [_exists(p) for p in (first, second, third, fourth, fifth)] == [
        False, False, True, True, True]
    assert _state(d)["all"] == ["ckpt-3", "ckpt-4", "ckpt-5"]
    assert latest_checkpoint(d) == fifth  # ModelCheckpoint's reader agrees


def test_custom_numbering_and_the_step_counter(tmp_path):
    """TF's ``CheckpointManagerTest.testCustomNumbering``: ``save(checkpoint_number=step)``
    names the checkpoint after a variable's value (or an int); the Checkpoint's save_counter
    still counts every save. ``checkpoint_interval`` skips saves until ``step_counter`` moved
    that far (``check_interval=False`` saves anyway)."""
    d = str(tmp_path / "numbered")
    step = dds.Variable(np.int64(0), name="step")
    ckpt = dds.Checkpoint(step=step)
    manager = dds.CheckpointManager(ckpt, d, max_to_keep=2)
    paths = []
    for _ in range(5):
        paths.append(manager.save(checkpoint_number=step))
        step.assign_add(2)
    assert [p.rsplit("-", 1)[1] for p in paths] == ["0", "2", "4", "6", "8"]
    assert ckpt.save_counter == 5
    last = manager.save(checkpoint_number=32)
    assert last == f"{d}/ckpt-32" == manager.latest_checkpoint
    assert manager.checkpoints == [paths[-1], last]

    d = str(tmp_path / "interval")
    step.assign(0)
    manager = dds.CheckpointManager(ckpt, d, max_to_keep=None, step_counter=step,
                                    checkpoint_interval=10, checkpoint_name="model")
    assert manager.save().endswith("/model-7")  # save_counter is 6 before it
    step.assign(9)
    assert manager.save() is None
    assert manager.save(check_interval=False) == f"{d}/model-8"
    step.assign(19)
    assert manager.save() == f"{d}/model-9"


def test_keep_checkpoint_every_n_hours_preserves(tmp_path):
    """TF's ``CheckpointManagerTest.testSaveRestoreState`` (preservation): a checkpoint leaving
    the ``max_to_keep`` window at least ``keep_checkpoint_every_n_hours`` after the last
    preserved one stays on storage and leaves the managed list; without it, it is deleted."""
    ckpt = dds.Checkpoint(w=dds.Variable(np.zeros(2), name="w"))
    kept = dds.CheckpointManager(ckpt, str(tmp_path / "kept"), max_to_keep=1,
                                 keep_checkpoint_every_n_hours=1e-9)  # every one preserved
    a, b, c = kept.save(), kept.save(), kept.save()
    assert kept.checkpoints == [c]
    assert [_exists(p) for p in (a, b, c)] == [True, True, True]
    state = _state(tmp_path / "kept")
    assert state["last_preserved_timestamp"] == pytest.approx(state["timestamps"][0], abs=5)
    plain = dds.CheckpointManager(ckpt, str(tmp_path / "plain"), max_to_keep=1)
    a, b, c = plain.save(), plain.save(), plain.save()
    assert [_exists(p) for p in (a, b, c)] == [False, False, True]


def test_restore_or_initialize(tmp_path):
    """TF's ``CheckpointManager.restore_or_initialize``: ``init_fn`` without a checkpoint,
    else the newest checkpoint restored and its path returned."""
    w = dds.Variable(np.zeros(3), name="w")
    calls = []
    manager = dds.CheckpointManager(dds.Checkpoint(w=w), str(tmp_path), max_to_keep=2,
                                    init_fn=lambda: calls.append("init"))
    assert manager.restore_or_initialize() is None and calls == ["init"]
    w.assign([1.0, 2.0, 3.0])
    path = manager.save()
    w.assign([9.0, 9.0, 9.0])
    again = dds.CheckpointManager(dds.Checkpoint(w=w), str(tmp_path), max_to_keep=2,
                                  init_fn=lambda: calls.append("init"))
    assert again.restore_or_initialize() == path
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0, 3.0])
    assert calls == ["init"]


@pytest.mark.pure
def test_bad_arguments():
    """TF's argument errors, with their types."""
    ckpt = dds.Checkpoint()
    with pytest.raises(TypeError, match=r"^checkpoint must be a dds.Checkpoint, got dict$"):
        dds.CheckpointManager({}, "/tmp/x", max_to_keep=1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"^max_to_keep must be a positive integer or None"):
            dds.CheckpointManager(ckpt, "/tmp/x", max_to_keep=bad)
    with pytest.raises(ValueError, match=r"^step_counter should be passed if "
                                         r"checkpoint_interval is not None$"):
        dds.CheckpointManager(ckpt, "/tmp/x", max_to_keep=1, checkpoint_interval=5)
    with pytest.raises(ValueError, match=r"^checkpoint_name must be a plain name"):
        dds.CheckpointManager(ckpt, "/tmp/x", max_to_keep=1, checkpoint_name="a/b")


def _train_save_restore(c, directory: str) -> None:
    """A sharded embedding and Adagrad on the parameter server: three steps saved by a
    manager (max_to_keep=2) on ``directory``, then fresh variables and optimizer restored
    from it; the fourth step gives the same values (slots restored) and iterations 3 -> 4."""
    strategy = dds.ParameterServerStrategy(c)
    grad = np.full((6, 4), 0.5, "f4")
    with strategy.scope():
        emb = dds.Variable(np.ones((6, 4), "f4"), name="emb")
        opt = optimizers.Adagrad(0.1)
    assert opt.iterations.ps_address is not None  # on the parameter server
    manager = dds.CheckpointManager(dds.Checkpoint(emb=emb, opt=opt), directory, max_to_keep=2)
    assert manager.restore_or_initialize() is None
    paths = []
    for _ in range(3):
        opt.apply_gradients([(grad, emb)])
        paths.append(manager.save())
    assert paths == [f"{directory}/ckpt-{n}" for n in (1, 2, 3)]
    assert manager.checkpoints == paths[1:]
    assert [_exists(p) for p in paths] == [False, True, True]
    saved = emb.numpy()
    assert int(opt.iterations) == 3
    opt.apply_gradients([(grad, emb)])
    expected = emb.numpy()

    with strategy.scope():
        emb2 = dds.Variable(np.zeros((6, 4), "f4"), name="emb_restored")
        opt2 = optimizers.Adagrad(0.1)
    assert int(opt2.iterations) == 0
    restored = dds.CheckpointManager(dds.Checkpoint(emb=emb2, opt=opt2), directory,
                                     max_to_keep=2)
    assert restored.restore_or_initialize() == paths[2]
    np.testing.assert_array_equal(emb2.numpy(), saved)
    assert int(opt2.iterations) == 3
    opt2.apply_gradients([(grad, emb2)])
    np.testing.assert_array_equal(emb2.numpy(), expected)  # the accumulator came back too
    assert int(opt2.iterations) == 4


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, WK])
async def test_checkpoint_manager_on_memory_url(s, p0, w0):
    """TF's checkpoint_management_test.py ``testDeletion`` end to end on a parameter server,
    with the checkpoints on ``memory://`` (zarr's FsspecStore; the PS writes its shards
    there), and Keras' ``optimizer.iterations`` saved and restored."""
    directory = f"memory://dds-ckpt/{uuid.uuid4().hex}"
    try:
        await in_thread(s, lambda c: _train_save_restore(c, directory))
    finally:
        fsspec.filesystem("memory").rm(directory.split("://", 1)[1], recursive=True)


@pytest.fixture(scope="module")
def s3():
    with s3_emulator("dds-ckpt") as url:
        yield url


@pytest.mark.process  # the S3 emulator is a process of its own
@gen_cluster(client=False, nthreads=[PS, WK])
async def test_checkpoint_manager_on_s3(s, p0, w0, s3):
    """The same on an S3 emulator (``s3://``): numbered saves, deletion, restore, iterations."""
    await in_thread(s, lambda c: _train_save_restore(c, f"{s3}/{uuid.uuid4().hex}"))


def test_checkpoint_of_an_older_format_without_iterations_restores(tmp_path):
    """A checkpoint saved before optimizers had ``iterations`` (no ``<opt>/iterations``
    entry) restores; the optimizer's count stays as it was."""
    w = dds.Variable(np.ones(2), name="w")
    path = str(tmp_path / "old")
    dds.Checkpoint(w=w).save(path)  # what an older package wrote for Checkpoint(w=, opt=)
    opt = optimizers.SGD(0.1)
    opt.iterations.assign(7)
    w.assign([5.0, 5.0])
    dds.Checkpoint(w=w, opt=opt).restore(path)
    np.testing.assert_array_equal(w.numpy(), [1.0, 1.0])
    assert int(opt.iterations) == 7
