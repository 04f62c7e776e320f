"""Registering with a scheduler that died (issue 22 s5): a ``DataServiceError`` naming the
scheduler's address within ``dataservice.client.dispatcher-timeout`` (at once when the client
has already given up on its scheduler), never distributed's ``OSError`` after its 30 s connect
timeout. A real scheduler process, killed with SIGKILL before the calls."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import dask
import pytest
from _helpers import Servers, wait
from distributed import Client

import dask_dataservice as dds
from dask_dataservice.errors import DataServiceError

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


def _failure(call):
    """``(the DataServiceError raised by call(), seconds it took)``."""
    start = time.monotonic()
    with pytest.raises(DataServiceError) as info:
        call()
    return str(info.value), time.monotonic() - start


@pytest.mark.slow
def test_register_dataset_after_the_scheduler_was_killed(tmp_path):
    """A fresh client (the plugins not installed yet: before, ``CommClosedError`` after 30 s),
    a client that registered before (before: 30 s), a client that closed itself after losing
    its scheduler (at once) and an address: each a DataServiceError naming the address."""
    file = tmp_path / "scheduler.json"
    with Servers() as servers, dask.config.set({"dataservice.client.dispatcher-timeout": "2s",
                                                "dataservice.client.connect-timeout": "2s"}):
        proc = servers.start(sys.executable, "-m", "distributed.cli.dask_scheduler", "--host",
                             "127.0.0.1", "--port", "0", "--no-dashboard", "--scheduler-file",
                             str(file))
        wait(lambda: file.exists() and file.stat().st_size > 0, 60, "the scheduler file")
        address = json.loads(file.read_text())["address"]
        # the clients keep trying to reconnect for a minute (Client(timeout=)), the quitter 2 s
        with Client(address, timeout="60s", set_as_default=False) as fresh, \
                Client(address, timeout="60s", set_as_default=False) as used, \
                Client(address, timeout="2s", set_as_default=False) as quitter:
            assert isinstance(dds.register_dataset(used, dds.Dataset.range(3)), str)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

            message, took = _failure(lambda: dds.register_dataset(fresh, dds.Dataset.range(4)))
            assert message.startswith(
                f"plugin installation: the data service at {address} cannot be reached (tried "
                "for dataservice.client.dispatcher-timeout, 2 s): "), message
            assert took < 10, took  # 2 s and the time to notice, not the 30 s connect timeout

            message, took = _failure(lambda: dds.register_dataset(used, dds.Dataset.range(5)))
            assert re.fullmatch(re.escape(
                f"dataset registration: the data service at {address} did not come back within "
                "dataservice.client.dispatcher-timeout: ") + ".*(OSError|CommClosedError).*",
                message), message
            assert took < 10, took

            wait(lambda: quitter.status == "closed", 30, "the client to give up its scheduler")
            message, took = _failure(lambda: dds.register_dataset(quitter, dds.Dataset.range(6)))
            assert message == (
                f"the distributed.Client given as service: the data service at {address} cannot "
                "be reached: the distributed.Client is closed (a client closes itself when it "
                "cannot reconnect to its scheduler within its timeout)"), message
            assert took < 1, took

            message, took = _failure(lambda: dds.install(fresh))
            assert message.startswith(f"plugin installation: the data service at {address} "
                                      "cannot be reached"), message
            assert took < 10, took
        # a client that closed itself leaves its loop thread running, and close() then returns
        # at once (distributed 2026.8): stop the thread here
        quitter._loop_runner.stop()
        # an address: no live client for it any more, so it is tried for connect-timeout
        message, took = _failure(lambda: dds.register_dataset(address, dds.Dataset.range(7)))
        assert message.startswith(f"cannot reach the data service at {address}: "), message
        assert took < 10, took
