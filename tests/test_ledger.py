"""bench/ledger.py: every fast path of the ledger can still be taken out of the tree as written (each edit matches
exactly once), so docs/performance.md's ledger rows can be measured again; the verdict's arithmetic."""
from __future__ import annotations

import pytest

from bench import ledger


@pytest.mark.parametrize("name", sorted(ledger.PATHS))
def test_each_fast_path_can_be_taken_out_of_this_tree(name):
    for file, text, _ in ledger.PATHS[name].edits:
        assert (ledger.ROOT / file).read_text().count(text) == 1, (name, file, text)


def test_the_verdict_says_whether_the_gain_is_beyond_the_noise():
    before = {"median": 100.0, "min": 98.0, "max": 102.0}
    fast = ledger.verdict("x", "http:1000:2", before, {"median": 110.0, "min": 108.0, "max": 111.0})
    assert fast["gain"] == 0.1 and fast["noise"] == 0.02 and fast["beyond_noise"]
    level = ledger.verdict("x", "http:1000:2", before, {"median": 101.0, "min": 95.0, "max": 104.0})
    assert not level["beyond_noise"]
