"""The worker's transports (base.py: the two interfaces, ``Transport`` for one exchange and ``TensorTransport``
for a step's tensors; endpoint.py: one PS, retried; http.py: request bodies, compressed as the job says; shm.py:
same-host files; attach.py: one PS's choice of those; sharded.py: every shard; faults.py: a connection that drops
and duplicates exchanges, for drills; mock.py: a transport that answers with a function, for tests)."""
