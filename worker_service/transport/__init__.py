"""The worker's tensor transports (base.py: the interface; http.py: request bodies; shm.py: same-host
files; faults.py: a connection that drops and duplicates exchanges, for drills)."""
