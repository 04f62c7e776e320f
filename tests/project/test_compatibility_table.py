"""The table of TensorFlow's items (docs/tf-compatibility.yaml) is complete, every test it names
exists, and docs/compatibility.md shows exactly the table (docs/compat_table.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))
import compat_table  # noqa: E402

#: The public names of the two TensorFlow documents (their imports, classes, methods, the
#: arguments and modes they document): each must be the subject of an entry.
TF_NAMES = {
    "data-service": [
        "distribute", "register_dataset", "from_dataset_id", "ShardingPolicy", "OFF", "DYNAMIC",
        "FILE", "DATA", "FILE_OR_DATA", "HINT", "SHARD_HINT", "parallel_epochs",
        "distributed_epoch", "DispatcherConfig", "DispatchServer", "WorkerConfig",
        "WorkerServer", "job_name", "consumer_index", "num_consumers", "CrossTrainerCache",
        "fault_tolerant_mode", "work_dir", "dispatcher_address", "target",
        "experimental_distribute_dataset", "distribute_datasets_from_function",
        "create_per_worker_dataset", "from_generator",
    ],
    "ps": [
        "ParameterServerStrategy", "cluster_resolver", "variable_partitioner", "ClusterCoordinator",
        "schedule", "join", "create_per_worker_dataset", "scope", "Variable", "ShardedVariable",
        "MinSizePartitioner", "MaxSizePartitioner", "FixedShardsPartitioner", "device",
        "Checkpoint", "CheckpointManager", "Model.fit", "DatasetCreator", "steps_per_epoch",
        "TF_CONFIG", "Server", "run", "reduce", "experimental_distribute_dataset",
        "distribute_datasets_from_function", "colocate_vars_with", "num_replicas_in_sync",
        "Embedding", "lookup",
    ],
}


def test_the_table_follows_its_schema():
    items = compat_table.load()
    assert len(items) >= 100
    assert {i.doc for i in items} == set(compat_table.DOCS)


def test_every_test_the_table_names_exists():
    assert compat_table.missing_tests(compat_table.load()) == []


def test_the_page_shows_the_table_as_generated():
    page = compat_table.PAGE.read_text(encoding="utf-8")
    assert compat_table.page_with(page, compat_table.render(compat_table.load())) == page, \
        "docs/compatibility.md is not up to date: run python docs/compat_table.py --write"


@pytest.mark.parametrize("doc", sorted(TF_NAMES))
def test_every_name_of_both_tensorflow_documents_has_an_entry(doc):
    text = " ".join(i.tf for i in compat_table.load() if i.doc == doc)
    assert [n for n in TF_NAMES[doc] if n not in text] == []


def test_no_entry_waits_for_work_in_progress():
    assert [i.id for i in compat_table.load() if i.pending] == []


@pytest.mark.parametrize("entry, message", [
    ("- {id: a, doc: ps, tf: x, status: differs, tests: [tests/a.py::test_a]}", "needs a 'why'"),
    ("- {id: a, doc: ps, tf: x, status: same}", "needs the tests that check it"),
    ("- {id: a, doc: ps, tf: x, status: maybe, why: y}", "status must be one of"),
    ("- {id: a, doc: tf, tf: x, status: tf-only, why: y}", "doc must be one of"),
    ("- {id: a, doc: ps, tf: x, status: same, tests: [test_a]}", "is not of the form"),
    ("- {id: a, doc: ps, tf: x, status: tf-only, why: y, extra: 1}", "unknown keys ['extra']"),
    ("- {id: a, doc: ps, tf: x, status: tf-only, why: y}\n"
     "- {id: a, doc: ps, tf: z, status: tf-only, why: y}", "entry 2 (a): the id is used twice"),
])
def test_a_broken_entry_is_refused_naming_it(tmp_path, entry, message):
    path = tmp_path / "t.yaml"
    path.write_text(entry)
    with pytest.raises(compat_table.TableError, match=re.escape(message)):
        compat_table.load(path)


def test_a_test_that_does_not_exist_is_named(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("async def test_here():\n    pass\n")
    items = [compat_table.Item(id="a", doc="ps", tf="x", status="same",
                               tests=("tests/test_x.py::test_here", "tests/test_x.py::test_gone",
                                      "tests/test_y.py::test_here"))]
    assert compat_table.missing_tests(items, tmp_path) == [
        "a: tests/test_x.py::test_gone", "a: tests/test_y.py::test_here"]
