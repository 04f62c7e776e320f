"""Equal splits: what the barrier costs and what ``drop`` drops.

Two (or three) consumer threads read one named DYNAMIC job of a loopback cluster (2 data
workers), as a plain shared job and as an equal split (``drop``, ``pad``): elements per
second over all consumers, elements per consumer, the drop (or padding), and the
``dataservice_equal_sync`` requests per consumer. Run:
``python benchmarks/equal_splits.py [--elements N] [--consumers N] [--batch B]``.
"""

from __future__ import annotations

import argparse
import threading
import time

from distributed import Client, LocalCluster

import dask_dataservice as dds


def run(client, dataset_id, n, equal, job, sleep):
    outs = [None] * n

    def consumer(i):
        kw = dict(consumer_index=i, num_consumers=n, equal=equal) if equal else {}
        ds = dds.from_dataset_id("distributed_epoch", client, dataset_id, job_name=job, **kw)
        got = 0
        for _ in ds:
            got += 1
            if sleep and i == 0:
                time.sleep(sleep)
        outs[i] = got

    threads = [threading.Thread(target=consumer, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, outs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--elements", type=int, default=20_001)
    p.add_argument("--consumers", type=int, default=2)
    p.add_argument("--batch", type=int, default=0, help="elements are batches of this many ints")
    p.add_argument("--sleep", type=float, default=0.0, help="consumer 0's seconds per element")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        dds.install(client)
        ds = dds.Dataset.range(a.elements)
        total = a.elements
        if a.batch:
            ds = ds.batch(a.batch)
            total = -(-a.elements // a.batch)
        dataset_id = dds.register_dataset(client, ds, split_size=100)
        for equal in (False, "drop", "pad"):
            for r in range(a.repeat):
                secs, outs = run(client, dataset_id, a.consumers, equal, f"{equal}-{r}", a.sleep)
                extra = total - sum(outs) if equal != "pad" else sum(outs) - total
                print(f"equal={equal!s:5} {sum(outs) / secs:10.0f} el/s  per consumer {outs}  "
                      f"{'drop' if equal != 'pad' else 'pad'} {extra}")


if __name__ == "__main__":
    main()
