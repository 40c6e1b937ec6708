"""The README documents every setting, and the two commands a fresh machine needs."""
from pathlib import Path

from ps_service.settings import PSSettings
from worker_service.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent


def env_names():
    for cls, prefix in ((PSSettings, "PS_"), (WorkerSettings, "WORKER_")):
        for name in cls.model_fields:
            yield prefix + name.upper()


def test_readme_has_every_env_var_and_the_commands():
    readme = (ROOT / "README.md").read_text()
    missing = [n for n in env_names() if f"`{n}`" not in readme]
    assert not missing, f"README lacks {missing}"
    for cmd in ("make run", "make test", "docker compose up --scale worker=4", "docs/protocol.md"):
        assert cmd in readme
