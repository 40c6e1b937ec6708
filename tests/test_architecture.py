"""docs/architecture.md and .importlinter: the layers' contracts hold (``lint-imports``), and the page names every
module of the product and the benches, so that a module added without its row fails here."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.timing import allow

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ps_service", "worker_service", "shared", "syncps", "cluster", "bench", "docgen")


def _modules() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name == "__init__.py" and not path.read_text().strip():
                continue  # an empty package marker
            out.append(path.relative_to(ROOT).as_posix())
    return out


def test_the_architecture_page_names_every_module():
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [m for m in _modules() if f"`{m}`" not in page]
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter")], cwd=ROOT, capture_output=True,
                          text=True, timeout=allow(120))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
