"""Optimizer slots in checkpoints (issue 11 s5): restored in a fresh process whatever order
it creates its optimizers in, or a clear error naming the slots that do not match."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dask_dataservice as dds
from dask_dataservice.errors import CheckpointMismatchError
from dask_dataservice.ps import optimizers as opt
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.pure, pytest.mark.timeout(120)]

warm_up_zarr()

from _helpers import PS, WK, in_thread  # noqa: E402

# One coordinator process with its own small cluster (a PS and a training worker in the
# process). ``save``: three steps, a checkpoint, then the next step's values. ``restore``:
# fresh variables and optimizers (created in the order given), the checkpoint restored,
# then the same next step's values.
_SCRIPT = textwrap.dedent('''
    import asyncio, json, sys
    import numpy as np
    from distributed import Client, Scheduler, Worker
    import dask_dataservice as dds
    from dask_dataservice.ps import optimizers as opt
    from dask_dataservice.ps._types import IndexedSlices

    mode, path, order = sys.argv[1:]

    def grads(step):
        rng = np.random.default_rng(step)
        return (IndexedSlices(rng.normal(size=(3, 4)).astype("f4"), np.array([0, 2, 5])),
                rng.normal(size=(4,)), rng.normal(size=(4,)))

    def body(address):
        with Client(address, set_as_default=False) as c:
            strategy = dds.ParameterServerStrategy(c)
            with strategy.scope():
                init = 1.0 if mode == "save" else 0.0
                emb = dds.Variable(np.full((6, 4), init, "f4"), name="emb")
                w = dds.Variable(np.full(4, init), name="w")
                b = dds.Variable(np.full(4, init), name="b")
            made = {}
            for kind in order.split(","):  # the creation order differs between runs
                made[kind] = {"adagrad": lambda: opt.Adagrad(0.1),
                              "adam": lambda: opt.Adam(0.05),
                              "sgd": lambda: opt.SGD(0.1, momentum=0.9)}[kind]()
            ada, adam, sgd = made["adagrad"], made["adam"], made["sgd"]

            def step(i):
                g_emb, g_w, g_b = grads(i)
                ada.apply_gradients([(g_emb, emb)])
                adam.apply_gradients([(g_w, w)])
                sgd.apply_gradients([(g_b, b)])

            ckpt = dds.Checkpoint(model={"emb": emb, "w": w, "b": b}, ada=ada, adam=adam, sgd=sgd)
            if mode == "save":
                for i in range(3):
                    step(i)
                ckpt.save(path)
            else:
                ckpt.restore(path)
            step(3)
            print(json.dumps({"emb": emb.numpy().tolist(), "w": w.numpy().tolist(),
                              "b": b.numpy().tolist()}))

    async def main():
        async with Scheduler(port=0, dashboard_address=":0") as s, \\
                Worker(s.address, nthreads=1, resources={"ps": 1}), \\
                Worker(s.address, nthreads=1):
            await asyncio.to_thread(body, s.address)

    asyncio.run(main())
''')


def _run(mode: str, path: str, order: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode, path, order],
                         capture_output=True, text=True, timeout=90,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.process
def test_slots_restore_in_a_fresh_process_whatever_the_creation_order(tmp_path):
    path = str(tmp_path / "ckpt")
    expected = _run("save", path, "adagrad,adam,sgd")
    got = _run("restore", path, "sgd,adam,adagrad")
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, err_msg=name)


def test_default_names_are_class_names_not_counters():
    assert [opt.Adagrad().name, opt.Adagrad().name, opt.Adam().name, opt.SGD().name] == \
        ["Adagrad", "Adagrad", "Adam", "SGD"]
    assert opt.Adagrad(name="emb_opt").name == "emb_opt"
    with pytest.raises(ValueError, match="non-empty str"):
        opt.Adagrad(name="")


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, WK])
async def test_unmatched_slots_are_an_error_before_anything_changes(s, p0, w0, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "c")

    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        with strategy.scope():
            v = dds.Variable(np.ones(3), name="v")
        first = opt.Adagrad(0.1, name="first")
        first.apply_gradients([(np.ones(3), v)])
        dds.Checkpoint(v=v, opt=first).save(path)
        first.apply_gradients([(np.ones(3), v)])
        now = v.numpy()
        # another name: the slots of 'first' would be left behind
        with pytest.raises(CheckpointMismatchError,
                           match=r"slots \['accumulator'\] of optimizer 'first' for variable "
                                 r"'v'.*named \['second'\].*name='first'"):
            dds.Checkpoint(v=v, opt=opt.Adagrad(0.1, name="second")).restore(path)
        # the right name but another kind: its slots differ
        with pytest.raises(CheckpointMismatchError, match=r"keeps slots \['iterations', 'm', 'v'\]"):
            dds.Checkpoint(v=v, opt=opt.Adam(0.1, name="first")).restore(path)
        np.testing.assert_array_equal(v.numpy(), now)  # nothing changed
        dds.Checkpoint(v=v, opt=opt.Adagrad(0.1, name="first")).restore(path)
        assert not np.array_equal(v.numpy(), now)

    await in_thread(s, body)
