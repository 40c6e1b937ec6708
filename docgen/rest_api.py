"""The REST API reference: the PS's OpenAPI schema and its refusal codes, rendered as Markdown.

Contract:

- :func:`schema` is the schema the PS serves at ``/openapi.json`` (``create_app(PSSettings()).openapi()``: no server
  started), with every setting at its default (no ``PS_*`` variable of the caller's environment).
- :func:`page` renders every path and method: its summary and description, who may call it (the bearer token of its
  security scheme), its parameters (where, type, default, required, meaning), its request body (media type and
  schema) and its responses. FastAPI lists a request its validation refuses as ``422 Validation Error``; the PS
  answers those with ``400 bad_request`` (``ps_service/http.py``), and the page says so, not the schema's 422.
  Then every refusal code the PS sends (``{"error": code, "detail": text}``), found in the code itself: the
  :class:`~shared.errors.ProtocolError` s raised in ``ps_service/`` and ``shared/`` (read from their syntax trees)
  and the core's codes with their statuses (``ps_service.http.STATUS``).
- :func:`models_page` renders the schema's models (``components.schemas``): one table of fields each.
"""
from __future__ import annotations

import ast
import os
from collections import defaultdict
from pathlib import Path
from typing import Any
from unittest import mock

from docgen.markdown import cell, prose

ROOT = Path(__file__).resolve().parents[1]
#: the callables that build a refusal with the status as first argument (None) or a fixed status; ``CoreError`` and
#: ``Unauthorized`` are read apart (their status comes from ``ps_service.http.STATUS`` or is 401)
RAISERS = {"ProtocolError": None, "bad_request": 400, "unprocessable": 422}
SCANNED = ("ps_service", "shared")
METHODS = ("get", "put", "post", "delete", "patch")


def schema() -> dict:
    from ps_service.app import create_app
    from ps_service.settings import PSSettings

    clean = {k: v for k, v in os.environ.items() if not k.startswith("PS_")}  # the defaults' schema, not this shell's
    with mock.patch.dict(os.environ, clean, clear=True):
        return create_app(PSSettings()).openapi()


def type_of(s: dict) -> str:
    """A JSON schema's type in a few words: ``integer``, ``string (shm, http)``, ``[Worker](#worker)`` or null."""
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[1]
        return f"[{name}](rest-api-models.md#{name.lower()})"
    if "anyOf" in s:
        return " or ".join(type_of(x) for x in s["anyOf"])
    if "enum" in s:
        return f"{s.get('type', 'value')} ({', '.join(map(str, s['enum']))})"
    if s.get("type") == "array":
        return f"array of {type_of(s.get('items', {}))}"
    if s.get("type") == "object" and isinstance(s.get("additionalProperties"), dict):
        return f"object of {type_of(s['additionalProperties'])}"
    if s.get("format") == "binary":
        return "bytes"
    out = s.get("type", "any")
    bounds = [f"{op} {s[k]}" for k, op in (("minimum", ">="), ("ge", ">="), ("exclusiveMinimum", ">"),
                                           ("maximum", "<="), ("maxLength", "length <="), ("minLength", "length >="))
              if k in s]
    return out + (f" ({', '.join(bounds)})" if bounds else "")


def _fields(s: dict) -> list[str]:
    required = set(s.get("required", []))
    rows = ["| field | type | required | meaning |", "|---|---|---|---|"]
    for name, f in s.get("properties", {}).items():
        rows.append(f"| `{name}` | {type_of(f)} | {'yes' if name in required else ''} "
                    f"| {cell(f.get('description', ''))} |")
    return rows


def _parameters(op: dict) -> list[str]:
    rows = ["| parameter | in | type | default | required | meaning |", "|---|---|---|---|---|---|"]
    for p in op.get("parameters", []):
        s = p.get("schema", {})
        default = f"`{s['default']!r}`" if "default" in s else ""
        rows.append(f"| `{p['name']}` | {p['in']} | {type_of(s)} | {default} | {'yes' if p.get('required') else ''} "
                    f"| {cell(p.get('description', s.get('description', '')))} |")
    return rows


def _body(op: dict) -> list[str]:
    out = []
    for media, content in op["requestBody"].get("content", {}).items():
        s = content.get("schema", {})
        out += [f"Request body (`{media}`{', required' if op['requestBody'].get('required') else ''}): "
                + (cell(s["description"]) if "description" in s else type_of(s)), ""]
        if s.get("properties"):
            out += [*_fields(s), ""]
    return out


def _responses(op: dict) -> list[str]:
    rows = ["| status | content | meaning |", "|---|---|---|"]
    for status, r in op.get("responses", {}).items():
        if status == "422" and r.get("description") == "Validation Error":
            rows.append("| 400 | application/json | `bad_request`: a parameter or body field the route's validation "
                        "refuses (the schema's 422 Validation Error; the PS answers 400) |")
            continue
        media = ", ".join(f"{m}: {type_of(c.get('schema', {}))}" if c.get("schema", {}).get("$ref") else m
                          for m, c in r.get("content", {}).items())
        rows.append(f"| {status} | {media} | {cell(r.get('description', ''))} |")
    if op.get("security"):
        rows.append("| 401 | application/json | `unauthorized`: the token is missing or wrong (when the PS has one) |")
    return rows


def _operation(spec: dict, path: str, method: str, op: dict) -> list[str]:
    out = [f"### `{method.upper()} {path}`", ""]
    text = op.get("summary", "")
    if op.get("description"):
        text = f"{text}: {op['description']}" if text else op["description"]
    out += [prose(text), ""]
    schemes = spec.get("components", {}).get("securitySchemes", {})
    names = [n for sec in op.get("security", []) for n in sec]
    out += [("Token: " + "; ".join(f"`{n}` ({cell(schemes.get(n, {}).get('description', 'bearer'))})"
                                   for n in names)) if names else "Token: none (always open).", ""]
    if op.get("parameters"):
        out += [*_parameters(op), ""]
    if "requestBody" in op:
        out += _body(op)
    return out + [*_responses(op), ""]


def _answered(node: ast.Dict) -> list[tuple[int, str]]:
    """(status, code) pairs of a literal map from statuses to codes (the HTTP layer's own answers)."""
    pairs = [(k.value, v.value) for k, v in zip(node.keys, node.values)
             if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)]
    ok = pairs and len(pairs) == len(node.keys) and all(
        isinstance(s, int) and 400 <= s < 600 and isinstance(c, str) for s, c in pairs)
    return pairs if ok else []


def _raised(node: ast.Call, status_of_core: dict[str, int]) -> tuple[int, str] | None:
    """(status, code) of a call that builds a refusal with constant arguments, else None."""
    name = getattr(node.func, "id", getattr(node.func, "attr", None))
    args = [a.value if isinstance(a, ast.Constant) else None for a in node.args]
    if name == "Unauthorized":
        return 401, "unauthorized"
    if name == "CoreError" and args and isinstance(args[0], str):
        return status_of_core[args[0]], args[0]
    if name not in RAISERS or not args:
        return None
    status, code = (args + [None])[:2] if RAISERS[name] is None else (RAISERS[name], args[0])
    return (status, code) if isinstance(status, int) and isinstance(code, str) else None


def refusals() -> dict[tuple[int, str], set[str]]:
    """(status, code) -> the modules that refuse with it, read from the source of ``ps_service`` and ``shared``."""
    from ps_service.http import STATUS

    found: dict[tuple[int, str], set[str]] = defaultdict(set)
    for pkg in SCANNED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                got = [_raised(node, STATUS)] if isinstance(node, ast.Call) else (
                    _answered(node) if isinstance(node, ast.Dict) else [])
                for pair in filter(None, got):
                    found[pair].add(path.relative_to(ROOT).as_posix())
    for code, status in STATUS.items():
        found.setdefault((status, code), set())
    return found


def _refusal_table() -> list[str]:
    rows = ["| status | code | refused in |", "|---:|---|---|"]
    for (status, code), modules in sorted(refusals().items()):
        where = ", ".join(f"`{m}`" for m in sorted(modules)) or "the core (`ps_service/http.py`'s `STATUS`)"
        rows.append(f"| {status} | `{code}` | {where} |")
    return rows


def page(spec: dict, header: str) -> str:
    info = spec["info"]
    out = ["# REST API", "", header, "", f"{cell(info['title'])} {info['version']}: {cell(info['description'])}",
           "The same schema is served by a running PS at `/openapi.json` (with Swagger UI at `/docs` and ReDoc at "
           "`/redoc`). The models the answers use are in [the REST API's models](rest-api-models.md).", "",
           "Every refusal is a 4xx (or 503) answer with the JSON body `{\"error\": code, \"detail\": text}` and leaves "
           "the PS's state as it was; the codes are listed [at the end](#refusal-codes). Which refusal each route sends "
           "when, and what the frames carry: [the protocol](../protocol.md#routes) and its "
           "[errors](../protocol.md#errors).", ""]
    by_tag: dict[str, list[tuple[str, str, dict]]] = defaultdict(list)
    for path, item in spec["paths"].items():
        for method in METHODS:
            if method in item:
                by_tag[(item[method].get("tags") or ["other"])[0]].append((path, method, item[method]))
    for tag, ops in by_tag.items():
        out += [f"## {tag.capitalize()}", ""]
        for path, method, op in ops:
            out += _operation(spec, path, method, op)
    out += ["## Refusal codes", "",
            "Every code the PS answers a refused request with, found in the source: the status, the code, and the "
            "modules that send it (a core code is raised in `ps_service/core/` and given its status by "
            "`ps_service/http.py`). Routes between PS shards are not in the schema; their codes are here too.", "",
            *_refusal_table()]
    return "\n".join(out).rstrip() + "\n"


def models_page(spec: dict, header: str) -> str:
    out = ["# REST API models", "", header, "",
           "The JSON bodies of [the REST API](rest-api.md)'s answers, from its OpenAPI schema's `components.schemas`.",
           ""]
    for name, s in sorted(spec.get("components", {}).get("schemas", {}).items()):
        out += [f"## {name}", ""]
        if s.get("description"):
            out += [cell(s["description"]), ""]
        out += [*_fields(s), ""] if s.get("properties") else [f"Type: {type_of(s)}", ""]
    return "\n".join(out).rstrip() + "\n"
