"""The dispatcher: the state of datasets, jobs, iterations, tasks and workers (:mod:`.state`),
its journal (:mod:`.journal`), and the scheduler plugin that serves it (:mod:`.plugin`).

It imports :mod:`..protocol` and nothing of the data workers or the readers.
"""
