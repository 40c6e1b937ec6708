"""ps_service/core/errors.py: every code the core refuses with has its HTTP status in ps_service/http.STATUS, and the
HTTP layer answers a CoreError with the JSON error body and that status."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ps_service.core.errors import CoreError
from ps_service.http import STATUS, refusal_response, status_of

CORE = Path(__file__).resolve().parents[1] / "ps_service" / "core"


def _codes_raised() -> set[str]:
    codes = set()
    for path in CORE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "CoreError":
                first = node.args[0] if node.args else None
                assert isinstance(first, ast.Constant), f"{path.name}:{node.lineno}: a CoreError code is a literal"
                codes.add(first.value)
    return codes


def test_every_core_code_has_a_status_and_no_status_is_left_over():
    raised = _codes_raised()
    assert raised and raised <= STATUS.keys(), sorted(raised - STATUS.keys())
    assert STATUS.keys() <= raised, f"codes the core never raises: {sorted(STATUS.keys() - raised)}"
    assert all(400 <= s < 500 for s in STATUS.values())


@pytest.mark.parametrize("code", sorted(STATUS))
def test_a_core_refusal_is_answered_with_its_status_and_the_json_error_body(code):
    exc = CoreError(code, "why")
    resp = refusal_response(exc)
    assert (resp.status_code, status_of(exc)) == (STATUS[code], STATUS[code])
    assert resp.body == b'{"error":"%s","detail":"why"}' % code.encode()
