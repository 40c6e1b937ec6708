"""``GET /metrics`` of a real PS (uvicorn, in a thread so the test can feed the runtime's counters) trained
by real worker processes: the format checked by promtool (or prometheus-client's parser) and the numbers."""
from __future__ import annotations

import shutil
import subprocess
import threading
import time

import httpx
import pytest
import uvicorn
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from cluster.processes import LocalCluster, free_port, wait_for
from tests.timing import allow
from ps_service.app import create_app
from ps_service.settings import PSSettings
from tests.conftest import degraded

STEPS = 40
WORKERS = 2
BATCH = 32
ALLOWED_LABELS = {"status", "state", "reason", "le"}


class ThreadServer:
    """A real uvicorn PS in this process: its Runtime is reachable as ``app.state.runtime``."""

    def __init__(self, settings: PSSettings) -> None:
        self.app = create_app(settings)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=settings.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ThreadServer":
        self.thread.start()
        wait_for(lambda: self.server.started, allow(30), "uvicorn to start")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(allow(15))


def samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of a text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def scrape(url: str, **headers) -> httpx.Response:
    r = httpx.get(f"{url}/metrics", headers=headers, timeout=allow(10.0))
    assert r.status_code == 200
    return r


@pytest.fixture(scope="module")
def job():
    port = free_port()
    settings = PSSettings(host="127.0.0.1", port=port, max_steps=STEPS, min_workers=WORKERS, startup_grace_seconds=0)
    with ThreadServer(settings) as ps:
        url = f"http://127.0.0.1:{port}"
        c = LocalCluster(WORKERS, port=port, worker_env={"WORKER_COMPUTE_DELAY_SECONDS": 0.03,
                                                         "WORKER_BATCH_SIZE": BATCH, "WORKER_LOG_EVERY_SECONDS": 60})
        try:
            for i in range(WORKERS):
                c.start_worker(i)

            def training_scrape():
                text = scrape(url).text
                s = samples(text)
                return text if s[("ps_job_state", (("state", "training"),))] == 1 and s[("ps_global_step", ())] >= 1 else None

            during = wait_for(training_scrape, allow(60), "a scrape while training")
            codes = c.wait_workers(allow(90))
            rt = ps.app.state.runtime
            rt.auth_failures = 3  # what the access-control and checkpoint code feed
            rt.checkpoint_info = {"step": STEPS, "path": "/tmp/ckpt", "time": time.time(), "duration_seconds": 0.25,
                                  "count": 2}
            out = {
                "codes": codes, "during": during, "text": scrape(url).text,
                "openmetrics": scrape(url, accept="application/openmetrics-text; version=1.0.0"),
                "status": httpx.get(f"{url}/v1/status", timeout=allow(10)).json(),
                "rounds": httpx.get(f"{url}/v1/rounds", params={"limit": 1000}, timeout=allow(10)).json()["rounds"],
            }
        except Exception as exc:
            raise AssertionError(f"job failed: {exc}; logs:\n{c.logs()}") from exc
        finally:
            c.stop()
        yield out


def test_format_passes_promtool_or_the_client_parser(job):
    promtool = shutil.which("promtool")
    if promtool is None:
        degraded("metrics format (test_metrics.py)", "promtool not installed (Debian package 'prometheus'): "
                 "checked with prometheus-client's parser only")
    for text in (job["during"], job["text"]):
        if promtool:
            res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                                 timeout=allow(30))
            assert res.returncode == 0, res.stdout + res.stderr
        families = list(text_string_to_metric_families(text))
        assert families
        for fam in families:
            assert fam.name.startswith("ps_"), fam.name
            for s in fam.samples:
                assert set(s.labels) <= ALLOWED_LABELS, (s.name, s.labels)
                if fam.type == "counter":
                    assert s.name.endswith(("_total", "_created")), s.name
    om = job["openmetrics"]
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n") and any(f.name == "ps_rounds" for f in parse_openmetrics(om.text))


def test_values_match_the_job(job):
    assert job["codes"] == [0] * WORKERS
    s, st, rounds = samples(job["text"]), job["status"], job["rounds"]
    assert s[("ps_global_step", ())] == STEPS == st["global_step"] == len(rounds)
    assert s[("ps_max_steps", ())] == STEPS
    assert s[("ps_rounds_total", (("reason", "full"),))] == STEPS
    assert s[("ps_rounds_total", (("reason", "deadline"),))] == 0
    assert s[("ps_pushes_total", (("status", "accepted"),))] == WORKERS * STEPS
    assert sum(v for (n, l), v in s.items() if n == "ps_pushes_total") == WORKERS * STEPS
    assert s[("ps_examples_total", ())] == WORKERS * STEPS * BATCH
    assert s[("ps_round_duration_seconds_count", ())] == STEPS
    assert s[("ps_round_duration_seconds_sum", ())] == pytest.approx(sum(r["duration_seconds"] for r in rounds))
    assert s[("ps_round_duration_seconds_bucket", (("le", "+Inf"),))] == STEPS
    assert s[("ps_round_duration_seconds_bucket", (("le", "0.025"),))] == 0  # every round waited the 0.03 s delay
    assert s[("ps_barrier_wait_seconds_count", ())] == WORKERS * STEPS
    waits = sum(r["duration_seconds"] - c["after_seconds"] for r in rounds for c in r["contributors"])
    assert s[("ps_barrier_wait_seconds_sum", ())] == pytest.approx(waits, abs=1e-6)
    assert s[("ps_straggler_wait_seconds_count", ())] == STEPS  # two contributors: every round has one
    assert s[("ps_straggler_wait_seconds_sum", ())] == pytest.approx(sum(r["straggler"]["waited_seconds"] for r in rounds))
    assert s[("ps_received_bytes_total", ())] == st["bytes_received"] > 0
    assert s[("ps_sent_bytes_total", ())] == st["bytes_sent"]  # 0 here: the workers share the PS's host
    assert s[("ps_shm_received_bytes_total", ())] == st["shm_bytes_received"] > 0
    assert s[("ps_shm_weights_copies_total", ())] == 0  # every answer a same-host one: the file holds the weights
    assert s[("ps_workers", (("state", "left"),))] == WORKERS and s[("ps_workers", (("state", "active"),))] == 0
    assert s[("ps_membership_changes_total", ())] == 2 * WORKERS  # joined + left
    assert s[("ps_job_state", (("state", "done"),))] == 1 and s[("ps_job_state", (("state", "training"),))] == 0
    assert s[("ps_loss", ())] == pytest.approx(st["loss"]["last"])
    assert ("ps_round_open_seconds", ()) not in s  # no open round once done
    assert s[("ps_start_time_seconds", ())] == pytest.approx(st["started_at"])


def test_counters_fed_by_other_components(job):
    s = samples(job["text"])
    assert s[("ps_auth_failures_total", ())] == 3
    assert s[("ps_checkpoints_total", ())] == 2 and s[("ps_checkpoint_last_step", ())] == STEPS
    assert s[("ps_checkpoint_last_duration_seconds", ())] == 0.25
    assert s[("ps_checkpoint_duration_seconds_count", ())] == 1 and s[("ps_checkpoint_duration_seconds_sum", ())] == 0.25
    assert job["status"]["auth_failures"] == 3 and job["status"]["checkpoint"]["count"] == 2
    assert job["status"]["checkpoint"]["step"] == STEPS and job["status"]["checkpoint"]["path"] == "/tmp/ckpt"


def test_scrape_while_training_shows_the_open_round(job):
    s = samples(job["during"])
    assert s[("ps_round_open_seconds", ())] >= 0 and 0 <= s[("ps_round_awaited_workers", ())] <= WORKERS
    assert s[("ps_workers", (("state", "active"),))] == WORKERS
    assert s[("ps_rounds_total", (("reason", "full"),))] == s[("ps_global_step", ())]


def test_rounds_closed_after_a_rewind_are_counted_once_each():
    """A live rollback (a sharded PS) takes the core back to an older step: the rounds it closes from there on are
    counted, each once, whether or not anything observed the core between the rewind and the next close."""
    from collections import deque
    from types import SimpleNamespace

    from ps_service.metrics import PSMetrics

    core = SimpleNamespace(rounds=deque(), global_step=0)
    rt = SimpleNamespace(core=core, observers=[], checkpoint_info=None)
    metrics = PSMetrics(rt)

    def close(step: int) -> None:
        core.rounds.append(SimpleNamespace(step=step, reason="full", duration=0.1, contributors=(), straggler=None,
                                           closed_at=1.0))
        core.global_step = step + 1
        metrics.observe()

    for step in range(10):
        close(step)
    while core.rounds[-1].step >= 5:  # back to step 5: the records of the abandoned steps are dropped
        core.rounds.pop()
    core.global_step = 5
    metrics.observe()  # the runtime's notify after the rewind
    for step in range(5, 8):
        close(step)
    assert metrics.registry.get_sample_value("ps_rounds_total", {"reason": "full"}) == 13
