"""The torch image on ``docker compose`` for real: the Dockerfile built with ``EXTRAS=mlp,torch`` from a
local CPU wheel of torch (``wheels/``, docs/torch.md "Image"), then the ``cnn`` task trained by 4 worker
containers and the PS to the end.

The wheel comes from :data:`WHEELS` (PyTorch's CPU index is out of reach on the machine this suite
grew on); without the pinned CPU wheel there, or without a Docker engine, the test is skipped and the
suite's summary lists it under "degraded checks". The build runs in a copy of the build context
(``compose_util.build_context``), so the working tree never holds the wheel, and its image is tagged
with the copy's digest: a later run with the same inputs reuses it and builds nothing.
Measured times are printed past the capture.
"""
from __future__ import annotations

import re
import tempfile
import time
import tomllib
from pathlib import Path

import pytest

from tests.compose_util import (
    ROOT,
    ComposeProject,
    build_context,
    compose_unavailable,
    docker,
)
from tests.conftest import degraded
from tests.test_compose import logs_on_failure, report
from tests.timing import allow

pytestmark = [pytest.mark.compose, pytest.mark.timeout(900)]

WHEELS = Path("/opt/wheels")
#: the Dockerfile's Python (python:3.11-slim), which the wheel must fit
WHEEL_TAG = "cp311-cp311-manylinux_2_28_x86_64"
STEPS = 40
CHECK = "compose torch image + cnn task (test_compose_torch.py)"
FINISHED = re.compile(r"FINISHED: training done at global step (\d+).*evaluation loss=(\S+), accuracy=(\S+)")


def pinned_torch() -> str:
    """The version pyproject.toml's torch extra pins (``torch==X``)."""
    (spec,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["torch"]
    return spec.split("==")[1]


def skip(request, reason: str) -> None:
    report(request, f"COMPOSE TORCH TEST SKIPPED: {reason}")
    degraded(CHECK, f"skipped: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def torch_image(request) -> str:
    """The image built with EXTRAS=mlp,torch from the local wheel (reused when built from the same inputs)."""
    reason = compose_unavailable()
    if reason:
        skip(request, reason)
    wheel = WHEELS / f"torch-{pinned_torch()}+cpu-{WHEEL_TAG}.whl"
    if not wheel.is_file():
        skip(request, f"no {wheel} (torch's CPU wheel for the image; PyTorch's CPU index is not used by tests)")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="syncps-torch-context-") as tmp:
        tag = f"syncps:compose-torch-{build_context(Path(tmp), [wheel])}"
        if docker("image", "inspect", tag, check=False).returncode == 0:
            report(request, f"[compose torch] {tag} already built from these inputs: reused")
            return tag
        builder = ComposeProject("torchbuild", {"SYNCPS_EXTRAS": "mlp,torch", "SYNCPS_IMAGE": tag}, root=Path(tmp))
        try:
            builder.compose("build", "ps", timeout=900)
        finally:
            builder.env_file.unlink(missing_ok=True)
    for old in docker("images", "--format", "{{.Repository}}:{{.Tag}}", "syncps:compose-torch-*").stdout.split():
        if old != tag:
            docker("rmi", old, check=False)  # built from older inputs
    size = int(docker("image", "inspect", "-f", "{{.Size}}", tag).stdout)
    report(request, f"[compose torch] {tag} built in {time.monotonic() - t0:.1f} s: {size / 1e6:.0f} MB")
    return tag


def test_cnn_task_trains_on_the_torch_image_with_4_workers(torch_image, request):
    # torch from the wheel, the CPU build (a CUDA build would be torch-2.13.0.dist-info and several GB)
    dist = docker("run", "--rm", torch_image, "sh", "-c", "ls -d /opt/venv/lib/python3*/site-packages/torch-*.dist-info")
    assert dist.stdout.strip().endswith(f"torch-{pinned_torch()}+cpu.dist-info"), dist.stdout
    assert int(docker("image", "inspect", "-f", "{{.Size}}", torch_image).stdout) < 2e9
    # PS_MIN_WORKERS=4: step 0 waits for the 4 workers (importing torch takes seconds each), so all push every round
    p = ComposeProject("cnn", {"SYNCPS_IMAGE": torch_image, "SYNCPS_EXTRAS": "mlp,torch", "WORKER_TASK": "cnn",
                               "PS_MAX_STEPS": STEPS, "PS_MIN_WORKERS": 4})
    try:
        with logs_on_failure(p):
            t0 = time.monotonic()
            p.compose("up", "-d", "--scale", "worker=4", timeout=300)
            done = p.wait_status(lambda s: s["state"] == "done", allow(300), "the cnn job to finish")
            t_done = time.monotonic() - t0
            assert done["global_step"] == STEPS and done["optimizer"]["flavor"] == "torch"
            assert done["pushes"]["accepted"] == 4 * STEPS, done["pushes"]
            workers = p.workers()["workers"]
            assert sorted(w["name"] for w in workers if w["pushes"]["accepted"] == STEPS) == \
                [f"{p.name}-worker-{i}" for i in range(1, 5)]
            assert {w["transport"] for w in workers} == {"shm"}
            containers = p.wait_workers_exited(allow(120))
            t_exit = time.monotonic() - t0
            assert [c["State"]["ExitCode"] for c in containers] == [0] * 4
            finished = FINISHED.findall(p.compose("logs", "--no-color", "worker").stdout)
            assert len(finished) == 4 and len(set(finished)) == 1, finished  # one final model, evaluated by each
            step, loss, accuracy = int(finished[0][0]), float(finished[0][1]), float(finished[0][2])
            report(request, f"[compose torch] up -d --scale worker=4 -> {STEPS} cnn steps done in {t_done:.1f} s, "
                            f"workers exited after {t_exit:.1f} s; held-out loss {loss:g}, accuracy {accuracy:.4f}")
            assert step == STEPS and accuracy >= 0.8 and loss < 1.0  # 10 classes: chance is 0.1, ln 10 = 2.3
    finally:
        leftovers = p.down()
    assert leftovers == [], f"docker compose down -v left {leftovers}"
