"""The ``mypy --strict`` run of tests/project/test_typing.py starts when the collection ends.

A cold run (a fresh clone has no ``.mypy_cache``) takes about 50 s of one core. Started in the
background as soon as the collection has selected the test that reads it, it runs while the
tests collected before that one run (which mostly wait on clusters and processes, leaving the
second core idle); the test then waits for the same run and checks its whole report. Not
started for ``--collect-only`` or when the test is not selected; ended at the session's end if
it is still running (the run was stopped early, say by ``-x``).
"""

from __future__ import annotations

import importlib.util

import pytest
from _mypy import session_run, stop_session_run

#: The test that reads the run (tests/project/test_typing.py).
MYPY_TEST = "test_package_and_a_users_snippets_pass_mypy_strict"


@pytest.hookimpl(trylast=True)  # after ``-m``/``-k`` deselected: only a selected test starts it
def pytest_collection_modifyitems(session, config, items):
    if config.option.collectonly or hasattr(config, "workerinput"):
        return  # under pytest-xdist every worker collects every test: the one that runs it starts it
    if importlib.util.find_spec("mypy") is None:
        return  # the test skips (or fails under DASK_DATASERVICE_REQUIRE_ALL_TESTS), naming [lint]
    if any(getattr(item, "originalname", item.name) == MYPY_TEST for item in items):
        session_run()


def pytest_sessionfinish(session, exitstatus):
    stop_session_run()
