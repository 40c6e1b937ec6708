"""The PS and the numpy path stay torch-free: with every ``import torch`` refused (a ``sys.meta_path`` finder
installed by a ``sitecustomize`` on ``PYTHONPATH``, so the cluster's PS and worker processes refuse it
too), the PS app, the worker and ``syncps`` import, ``python -m cluster`` trains the linear task, and
what does need torch says which extra brings it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.timing import allow

ROOT = Path(__file__).resolve().parent.parent
BLOCK = '''
import sys


class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"No module named {name!r} (blocked by the torch-free test)")
        return None


sys.meta_path.insert(0, NoTorch())
'''
CHECK = '''
import sys
import ps_service.app, worker_service.__main__, worker_service.tasks, syncps, syncps.sampling
ps_service.app.create_app
try:
    import torch
except ImportError:
    pass
else:
    raise SystemExit("torch was importable")
for what in ("import syncps.torch", "import worker_service.tasks as t; t.load_task('cnn')"):
    try:
        exec(what)
    except ImportError as exc:
        print(exc)
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules), "torch got imported"
'''


def test_the_ps_and_the_numpy_path_run_without_torch(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    check = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=allow(120))
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.splitlines() == ["syncps.torch needs PyTorch: pip install -e '.[torch]'",
                                         "the cnn task needs PyTorch: pip install -e '.[torch,mlp]'"]
    run = subprocess.run([sys.executable, "-m", "cluster", "--workers", "2", "--task", "linear", "--steps", "20"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=allow(180))
    assert run.returncode == 0 and "every worker exited 0" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
