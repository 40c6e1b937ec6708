"""The same-host log of a hot-standby pair (ps_service/standby/ring.py; docs/protocol-standby.md, "Same host: the
log"): records read in order once committed, a torn or foreign one never; a full ring refuses the next record until
the standby applied one; a closed log refuses its writer; a file that is not the one advertised is not mapped; a
writer process kill -9'd at random moments (mid-record too) leaves every record it counted readable, whole."""
from __future__ import annotations

import os
import random
import signal
import time

import numpy as np
import pytest

from ps_service.standby import ring
from shared import frame, shm
from tests.timing import allow

MODEL = frame.Layout.of({"w": np.zeros(1000, np.float32)})


@pytest.fixture
def log(tmp_path):
    made = ring.Log.create(str(tmp_path), MODEL, applied=7)
    yield made
    made.remove()


def write(w: ring.LogWriter, seq: int, term: int, payload: bytes) -> int:
    w.begin(seq)[:len(payload)] = payload
    return w.commit(seq, term, True, len(payload))


def test_records_are_read_in_order_once_committed_and_a_full_ring_waits_for_the_standby(log, tmp_path):
    w = ring.LogWriter.open(str(tmp_path), log.advert())
    assert (w.slots, w.applied) == (ring.SLOTS, 7) and os.stat(log.path).st_mode & 0o777 == 0o600
    for seq in range(8, 8 + w.slots):
        assert w.room(seq) and write(w, seq, 3, b"step %d" % seq) == 0
    assert not w.room(8 + w.slots)  # full: the standby applied none
    assert log.record(8, 3) == (True, memoryview(b"step 8")) and log.record(8, 2) is None  # another term's: no
    log.applied = 8
    assert w.room(8 + w.slots) and not w.room(9 + w.slots)
    body = w.begin(8 + w.slots)  # slot of record 8 reused: a torn record (no commit marker) is no record
    body[:4] = b"torn"
    assert log.record(8 + w.slots, 3) is None and log.record(8, 3) is None
    assert write(w, 8 + w.slots, 3, b"next lap") == 0 and log.record(8 + w.slots, 3)[1] == b"next lap"
    assert log.record(9, 3)[1] == b"step 9"
    log.applied = 9
    log.close_for(4)  # the standby took over with term 4 (or took a new state): no record counts any more
    assert write(w, 9 + w.slots, 3, b"late") == 4


def test_a_file_that_is_not_the_log_advertised_is_not_mapped(log, tmp_path):
    d, ad = str(tmp_path), log.advert()
    with pytest.raises(ValueError, match="nonce"):
        ring.LogWriter.open(d, {**ad, "nonce": os.urandom(16).hex()})
    for wrong in ({"slots": ad["slots"] - 1}, {"slot_bytes": ad["slot_bytes"] + shm.PAGE}, {"slots": 99},
                  {"name": "../" + ad["name"]}, {"slot_bytes": 100}):
        with pytest.raises(ValueError):
            ring.LogWriter.open(d, {**ad, **wrong})
    with pytest.raises(OSError):  # no such file here: another host's
        ring.LogWriter.open(d, {**ad, "name": "syncps-l-" + "0" * 32})
    other = f"syncps-l-{'1' * 32}"  # a file of another kind under a log's name
    shm.create_region(d, other, shm.KIND_WEIGHTS, MODEL, log.nonce, 0)
    with pytest.raises(ValueError):
        ring.LogWriter.open(d, {**ad, "name": other})
    os.link(log.path, os.path.join(d, "second-link"))  # two links: refused
    with pytest.raises(PermissionError):
        ring.LogWriter.open(d, ad)
    os.unlink(os.path.join(d, "second-link"))
    os.rename(log.path, log.path + ".x")
    os.symlink(log.path + ".x", log.path)  # a symlink to it: refused
    with pytest.raises(OSError):
        ring.LogWriter.open(d, ad)
    os.unlink(log.path)
    os.rename(log.path + ".x", log.path)
    assert ring.LogWriter.open(d, ad).applied == 7


def test_the_sweep_unlinks_only_the_logs_of_standbys_that_are_gone(log, tmp_path):
    gone = ring.Log.create(str(tmp_path), MODEL, 0)
    os.close(gone._fd)  # its process died: the flock went with its descriptors (the mapping holds one)
    gone.release()
    ring.sweep(str(tmp_path))
    assert not os.path.exists(gone.path) and os.path.exists(log.path)


def writer(directory: str, advert: dict, seq: int, out: int, die_at: tuple[int, int] | None) -> None:
    """The forked primary: writes records after ``seq`` as fast as the ring lets it, printing each one it counted;
    ``die_at`` (seq, byte): kill -9 itself once it wrote that many bytes of that record."""
    w = ring.LogWriter.open(directory, advert)
    while True:
        seq += 1
        while not w.room(seq):
            pass
        n, body = (seq % 5 + 1) * 100_000, w.begin(seq)
        for at in range(0, n, 4096):
            if die_at is not None and die_at[0] == seq and at >= die_at[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            body[at:min(n, at + 4096)] = bytes([seq % 251]) * (min(n, at + 4096) - at)
        assert w.commit(seq, 5, True, n) == 0
        os.write(out, b"%d\n" % seq)


def whole(body: memoryview, seq: int) -> bool:
    got = np.frombuffer(body, np.uint8)
    return len(got) == (seq % 5 + 1) * 100_000 and bool((got == seq % 251).all())


def test_a_writer_killed_at_random_moments_leaves_every_record_it_counted_whole(tmp_path):
    """The primary kill -9'd at a random moment (often mid-record: most of its time is spent writing bodies), 8
    times: every record it printed (counted) is read whole, in order, and nothing after the last committed one."""
    rng = random.Random(51)
    big = frame.Layout.of({"w": np.zeros(130_000, np.float32)})
    log = ring.Log.create(str(tmp_path), big, applied=0, slots=3)
    seq, torn = 0, 0
    try:
        for i in range(8):
            kill_after = rng.randint(1, 12)  # the test kills it then (even runs), or it kills itself mid-record
            die_at = None if i % 2 == 0 else (seq + kill_after, rng.randrange(0, 100_000))
            r, out = os.pipe()
            child = os.fork()
            if child == 0:  # pragma: no cover (the child)
                try:
                    os.close(r)
                    writer(str(tmp_path), log.advert(), seq, out, die_at)
                finally:
                    os._exit(1)
            os.close(out)
            counted, deadline, dead = [], time.monotonic() + allow(20), False
            while len(counted) < kill_after and time.monotonic() < deadline and not dead:
                dead = os.waitpid(child, os.WNOHANG)[0] != 0
                got = log.record(seq + 1, 5)  # the standby reads behind, applying in order
                if got is not None:
                    assert whole(got[1], seq + 1)
                    seq += 1
                    log.applied = seq
                    counted.append(seq)
            if not dead:
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
            with os.fdopen(r) as f:
                printed = [int(x) for x in f.read().split()]
            while (got := log.record(seq + 1, 5)) is not None:  # a takeover: every committed record, then none
                assert whole(got[1], seq + 1)
                seq += 1
                log.applied = seq
            torn += seq >= log.slots and log.slot(seq + 1)[0][ring.SEQ] == 0  # killed while it wrote seq + 1
            last = max(printed, default=counted[0] - 1)  # every record counted is read; one more may be committed,
            assert last <= seq <= last + 1  # its print cut off by the kill
        assert torn >= 4, torn  # (its own kills at least)
    finally:
        log.remove()
