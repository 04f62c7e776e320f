"""What the data service's roles share: the wire messages and frames, the sharding policies,
the op names, job-token checks, input positions and the read counters.

The dispatcher (:mod:`..dispatcher`), the data workers (:mod:`..worker`) and the readers
(:mod:`..client`) each import from here and never from one another.
"""
