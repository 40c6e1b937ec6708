"""docs/torch.md's training script runs as written: two copies train against a real PS until it is done. The README
shows the same script (checked here), so it runs too."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

from cluster.processes import wait_for
from tests.timing import allow
from tests.live_ps import live_ps
from tests.torch_util import logs, start_workers

DOC = Path(__file__).resolve().parent.parent / "docs" / "torch.md"
README = DOC.parent.parent / "README.md"
STEPS = 30


def documented_script(text: str, heading: str) -> str:
    """The first ```python block after ``heading``."""
    return re.search(rf"{heading}.*?```python\n(.*?)```", text, re.S).group(1)


def test_the_readme_shows_the_same_script():
    assert documented_script(README.read_text(), "## Your own PyTorch model") == \
        documented_script(DOC.read_text(), "## A training script")
    readme = README.read_text()  # the commands after it run the file the README says to save it as
    assert "saved as `train.py`" in readme and "python train.py" in readme


def test_the_documented_script_trains_with_two_workers():
    script = documented_script(DOC.read_text(), "## A training script")
    assert 15 <= len(script.strip().splitlines()) <= 25
    with tempfile.TemporaryDirectory(prefix="syncps-doc-") as tmp, \
            tempfile.TemporaryDirectory(prefix="syncps-doc-late-") as late, \
            live_ps(min_workers=2, max_steps=STEPS, startup_grace_seconds=0) as ps:
        path = Path(tmp) / "train.py"
        path.write_text(script)
        procs = start_workers(2, ps.url, {}, Path(tmp), script=str(path))
        wait_for(lambda: all(p.exitcode is not None for p in procs), allow(120), "the scripts to end", 0.1)
        out = logs(Path(tmp))
        assert [p.exitcode for p in procs] == [0, 0], out
        with ps.http() as http:
            assert http.get("/v1/status").json()["state"] == "done"
        assert ps.rt.core.examples >= 2 * STEPS  # the script passes num_examples: /v1/status shows examples/s
        # a copy started once the job is done ends at once with the final weights (it raised NameError: no loss)
        proc = start_workers(1, ps.url, {"WORKER_NAME": "latecomer"}, Path(late), script=str(path))[0]
        wait_for(lambda: proc.exitcode is not None, allow(60), "the late script to end", 0.1)
        late_out = logs(Path(late))
        assert proc.exitcode == 0, late_out
    finals = re.findall(rf"done at global step {STEPS}, loss on all the data (\S+)", out + late_out)
    assert len(finals) == 3 and len(set(finals)) == 1, out + late_out  # the same final weights in all three
    assert "rank 0, the round's ranks (0, 1)" in out and "rank 1, the round's ranks (0, 1)" in out, out
