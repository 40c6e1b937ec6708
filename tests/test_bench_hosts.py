"""``python -m bench.hosts``: emulated hosts (network namespaces, shaped veth links) come up, carry syncps runs
across their links (two PS shards, each in a host of its own, then one beside each worker), and are gone afterwards,
even after a run that did not remove them. Needs root, ``ip`` and ``tc`` (skipped otherwise); a prefix and subnet of
this test process's own (from its pid), so it disturbs neither a benchmark nor another test run on the machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.hosts import Hosts, available, namespaces, sh
from tests.timing import allow

PREFIX, SUBNET = f"spt{os.getpid() % 10000:04d}", f"10.89.{os.getpid() % 250}"


pytestmark = pytest.mark.skipif(not available(PREFIX), reason="needs root with ip, tc and network namespaces")


def _links() -> list[str]:
    return [line for line in sh("ip", "-o", "link", "show").stdout.splitlines() if f" {PREFIX}" in line]


def _bench_hosts(*args: str) -> tuple[str, list[dict]]:
    """Run ``python -m bench.hosts`` (syncps, 2 workers, 10,000 params, 1 Gbit/s) with ``args``: its output and
    lines."""
    out = subprocess.run([sys.executable, "-m", "bench.hosts", "--json", "--rate", "1gbit", "--workers", "2",
                          "--params", "10000",
                          "--systems", "syncps", "--prefix", PREFIX, "--subnet", SUBNET, *args],
                         check=False, capture_output=True, text=True, timeout=allow(90))
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    return out.stdout, [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_syncps_runs_between_shaped_hosts_each_shard_in_a_host_of_its_own_or_beside_its_worker():
    """One run covers it all: the shaped links (a TCP stream at about the rate), a PS of two shards each bound in a
    namespace of its own (one PS is the same code with one host), then ``syncps-colocated``: one shard per worker,
    shard k bound in worker k's namespace (BytePS's co-located servers); and the hosts are gone afterwards."""
    # a window of a few steps at least: on a loaded machine a step takes longer, and one pull re-asked in a window of
    # one or two steps would double its bytes a step
    seconds = f"{min(5.0, allow(1)):.1f}"
    stdout, (stream, run, colocated) = _bench_hosts("--seconds", seconds, "--warmup", "0.2", "--shards", "2",
                                                    "--systems", "syncps,syncps-colocated")
    assert stream["check"] == "tcp_stream" and 300 < stream["mbit_per_s"] < 1100  # shaped at 1 Gbit/s
    assert run["system"] == "syncps" and run["rate"] == "1gbit" and run["transport"] == "http"
    assert run["shards"] == 2 and run["shard_namespaces"] == [f"{PREFIX}-h0", f"{PREFIX}-h1"]
    assert run["worker_namespaces"] == [f"{PREFIX}-h2", f"{PREFIX}-h3"]  # hosts of their own, after the shards
    # each shard bound the address that only its namespace has: host i is SUBNET.(i+1)
    assert [url.rsplit(":", 1)[0] for url in run["shard_urls"]] == [f"http://{SUBNET}.1", f"http://{SUBNET}.2"]
    assert run["steps_per_s"] > 0 and run["final_loss"] < 1.0
    assert run["wire_bytes_per_step"] > 2 * 2 * 10_000 * 4  # pushes and weights
    per_shard = run["shard_wire_bytes_per_step"]  # the weights cut in two: each shard's link carries about half
    assert len(per_shard) == 2 and min(per_shard) > 0.4 * sum(per_shard) and sum(per_shard) > 2 * 2 * 10_000 * 4
    # worker k reaches its own shard by files (host k's same-host directory), the other one by request bodies: each
    # shard's link carries one worker's push and weights, not two
    assert colocated["system"] == "syncps-colocated" and colocated["shards"] == 2
    assert colocated["transport"] == "http+shm"  # as shard 0 sees them: worker 0 by files, worker 1 by bodies
    assert max(colocated["shard_wire_bytes_per_step"]) < 0.75 * 2 * 2 * (10_000 * 4 // 2)
    assert colocated["shard_namespaces"] == colocated["worker_namespaces"] == [f"{PREFIX}-h0", f"{PREFIX}-h1"]
    assert [url.rsplit(":", 1)[0] for url in colocated["shard_urls"]] == [f"http://{SUBNET}.1", f"http://{SUBNET}.2"]
    assert colocated["steps_per_s"] > 0 and colocated["final_loss"] < 1.0
    assert "| params | workers | syncps S=2 | syncps-colocated |" in stdout and "| 10,000 | 2 |" in stdout
    assert namespaces(PREFIX) == [] and _links() == []


def test_a_crashed_runs_hosts_are_replaced():
    crashed = Hosts(2, "1gbit", PREFIX, SUBNET).__enter__()  # never left: as a run killed by SIGKILL leaves them
    assert sorted(namespaces(PREFIX)) == [crashed.namespace(0), crashed.namespace(1)]
    with Hosts(2, "1gbit", PREFIX, SUBNET) as hosts:
        assert sorted(namespaces(PREFIX)) == [hosts.namespace(0), hosts.namespace(1)]
        assert "tbf" in sh(*hosts.exec_prefix(1), "tc", "qdisc", "show", "dev", hosts.device(1)).stdout
    assert namespaces(PREFIX) == [] and _links() == []
