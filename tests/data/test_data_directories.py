"""Format readers take directories, globs, lists and fsspec URLs (docs/sources-files.md).

A directory stands for the files under it, recursively, whose names end in the format's
extensions; names starting with ``.`` or ``_`` (``_SUCCESS``, ``.crc``) are skipped, and
nothing under such a directory is taken; a pattern that matches nothing is a
``FileNotFoundError`` naming it. Real files in tmp_path and fsspec's memory filesystem.
"""

from __future__ import annotations

import collections
import json
import uuid

import fsspec
import numpy as np
import pytest
from _helpers import distribute, needs, read

from dask_dataservice.data import Dataset
from dask_dataservice.data.tfrecord import write_records
from dask_dataservice.service.worker import current_task
from dask_dataservice.testing import gen_cluster

pytestmark = pytest.mark.pure


def tree(root, ext: str, write) -> list[str]:
    """``root/a<ext>``, ``root/sub/b<ext>``, ``root/sub/deeper/c<ext>`` (each written by
    ``write(path, i)``), plus files a directory read must skip: another extension, a hidden
    file, ``_SUCCESS``, and a file under a hidden and an ``_``-directory."""
    wanted = [root / f"a{ext}", root / "sub" / f"b{ext}", root / "sub" / "deeper" / f"c{ext}"]
    for i, path in enumerate(wanted):
        path.parent.mkdir(parents=True, exist_ok=True)
        write(str(path), i)
    (root / "notes.md").write_text("not data")
    (root / "_SUCCESS").write_text("")
    (root / f".a{ext}.crc").write_text("checksum")
    for hidden in (".cache", "_temporary"):
        (root / hidden).mkdir()
        write(str(root / hidden / f"x{ext}"), 99)
    return [str(p) for p in wanted]


def write_csv(path: str, i: int) -> None:
    open(path, "w").write(f"v\n{i}\n")


def write_jsonl(path: str, i: int) -> None:
    open(path, "w").write(json.dumps({"v": i}) + "\n")


def write_tfrecord(path: str, i: int) -> None:
    write_records(path, [str(i).encode()])


def write_text(path: str, i: int) -> None:
    open(path, "w").write(f"{i}\n")


def write_parquet(path: str, i: int) -> None:
    pa = needs("pyarrow", "parquet")
    pq = needs("pyarrow.parquet", "parquet")
    pq.write_table(pa.table({"v": [i]}), path)


def write_png(path: str, i: int) -> None:
    from PIL import Image

    Image.fromarray(np.full((2, 2), i, np.uint8)).save(path, format="PNG")


FORMATS = {
    "csv": (".csv", write_csv, Dataset.from_csv, lambda e: int(e["v"])),
    "jsonl": (".jsonl", write_jsonl, Dataset.from_json_lines, lambda e: int(e["v"])),
    "tfrecord": (".tfrecord", write_tfrecord, Dataset.from_tfrecord, lambda e: int(e)),
    "text": (".txt", write_text, Dataset.from_text_lines, lambda e: int(e)),
    "parquet": (".parquet", write_parquet, Dataset.from_parquet, lambda e: int(e["v"])),
    "images": (".png", write_png, Dataset.from_images, lambda e: int(e[0, 0])),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_directory_is_its_files_with_the_format_extension_recursively(tmp_path, fmt):
    ext, write, reader, value = FORMATS[fmt]
    files = tree(tmp_path, ext, write)
    by_hand = [value(e) for e in reader(files)]
    assert by_hand == [0, 1, 2]
    for given in (str(tmp_path), str(tmp_path) + "/", tmp_path):  # str, trailing /, PathLike
        ds = reader(given)
        assert [value(e) for e in ds] == by_hand
        assert ds.splits() == reader(files).splits()  # each file its split(s), as by hand
    # globs: one level, any depth (hidden names skipped), a glob matching directories
    assert [value(e) for e in reader(str(tmp_path / f"*{ext}"))] == [0]
    assert [value(e) for e in reader(str(tmp_path / "**" / f"*{ext}"))] == [0, 1, 2]
    assert [value(e) for e in reader(str(tmp_path / "su*"))] == [1, 2]
    # a list mixes them; duplicates are read once
    assert [value(e) for e in reader([str(tmp_path / "sub"), files[0], files[1]])] == [0, 1, 2]


@pytest.mark.parametrize("pattern, what", [
    ("empty", "a directory"), ("nothing-*.csv", "a glob"), ("missing.csv", "a missing path")])
def test_a_pattern_matching_no_file_is_a_clear_error_naming_it(tmp_path, pattern, what):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "data.json").write_text("{}")  # not a CSV
    target = str(tmp_path / pattern)
    with pytest.raises(FileNotFoundError) as info:
        Dataset.from_csv([str(tmp_path / "empty" / "data.json"), target])
    assert str(info.value) == (
        f"from_csv(): no files match {target!r} (a directory stands for the files ending in "
        ".csv, .tsv under it, recursively; names starting with '.' or '_' are skipped)")


def test_fsspec_urls_directories_and_globs():
    root = f"memory://d{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        for name in ("a.jsonl", "sub/b.jsonl", "_SUCCESS", "sub/c.txt", ".hidden/x.jsonl"):
            with fsspec.open(f"{root}/{name}", "w") as f:
                f.write(json.dumps({"v": name}) + "\n")
        for given in (root, root + "/", f"{root}/**/*.jsonl"):
            assert [e["v"] for e in Dataset.from_json_lines(given)] == ["a.jsonl", "sub/b.jsonl"]
        assert Dataset.from_json_lines(root).source.paths == (
            f"{root}/a.jsonl", f"{root}/sub/b.jsonl")
        with pytest.raises(FileNotFoundError, match=r"from_json_lines\(\): no files match "
                                                    rf"'{root}/nothing'"):
            Dataset.from_json_lines(f"{root}/nothing")
    finally:
        fs.rm(root, recursive=True)


def test_list_files_takes_a_directory_and_from_files_passes_paths_as_given(tmp_path):
    files = tree(tmp_path, ".txt", write_text)
    # every file (no format: no extension filter), hidden names skipped
    assert [str(p) for p in Dataset.list_files(str(tmp_path))] == sorted(
        [*files, str(tmp_path / "notes.md")])
    # from_files: a directory is one "file" to its reader (a zarr store), in the given order
    seen = list(Dataset.from_files([str(tmp_path / "sub"), files[0]], lambda p: [p]))
    assert seen == [str(tmp_path / "sub"), files[0]]


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)],
             config={"dataservice.dispatcher.worker-addresses": ["0", "1"]})
async def test_file_sharding_of_a_directory_shards_its_files(c, s, a, b):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for i in range(6):
            (root / f"part-{i}").mkdir()
            write_csv(str(root / f"part-{i}" / "data.csv"), i)
        (root / "_SUCCESS").write_text("")
        ds = Dataset.from_csv(d).map(lambda e: (current_task()["worker_index"], int(e["v"])))
        out = await read(await distribute(ds, "FILE", c))
    groups = collections.defaultdict(list)
    for worker, v in out:
        groups[worker].append(v)
    # file i (sorted) goes to worker i % 2, as it does when the files are listed by hand
    assert dict(groups) == {0: [0, 2, 4], 1: [1, 3, 5]}
