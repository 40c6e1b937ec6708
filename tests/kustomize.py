"""``kustomize build`` for the subset of kustomize deploy/k8s and deploy/k8s-shards use, in Python.

No kustomize binary comes with the project (``kubectl kustomize`` is one where kubectl is installed; the
suite does not need it): :func:`build` renders a kustomization folder as ``kubectl kustomize`` would, for
these fields only, and refuses any other, so a kustomization that starts using one fails here instead of
being rendered wrong:

- ``resources``: YAML files and folders with a kustomization of their own (built first, recursively);
- ``namespace``: set on every object;
- ``images``: ``name`` -> ``newName`` / ``newTag`` / ``digest`` on every container and init container;
- ``patches``: JSON 6902 patches (``add``, ``replace``, ``remove``; a list's ``-`` appends) with a
  ``target`` of group, version, kind and name.

:func:`kubectl_build` is the real thing when kubectl is on PATH (tests/test_k8s.py compares the two).
"""
from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import yaml

FIELDS = {"apiVersion", "kind", "namespace", "resources", "images", "patches"}
TARGET_FIELDS = {"group", "version", "kind", "name"}


class Unsupported(ValueError):
    """The kustomization uses something this subset does not render."""


def build(folder: str | Path) -> list[dict]:
    """The objects ``kubectl kustomize folder`` prints (in file order, not kustomize's kind order)."""
    folder = Path(folder)
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    extra = set(k) - FIELDS
    if extra:
        raise Unsupported(f"{folder}/kustomization.yaml: {sorted(extra)} not rendered by tests/kustomize.py")
    objects: list[dict] = []
    for res in k.get("resources", []):
        path = (folder / res).resolve()
        if path.is_dir():
            objects += build(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for p in k.get("patches", []):
        _patch(objects, p)
    for obj in objects:
        if "namespace" in k:
            obj.setdefault("metadata", {})["namespace"] = k["namespace"]
        for image in k.get("images", []):
            _set_image(obj, image)
    return objects


def _containers(obj: dict) -> list[dict]:
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def _set_image(obj: dict, image: dict) -> None:
    for c in _containers(obj):
        name = c["image"].split("@")[0]
        tail = name.rsplit("/", 1)[-1]
        if ":" in tail:
            name = name[: -len(tail)] + tail.split(":")[0]
        if name != image["name"]:
            continue
        new = image.get("newName", name)
        if "digest" in image:
            c["image"] = f"{new}@{image['digest']}"
        else:
            tag = image.get("newTag") or (c["image"][len(name) + 1:] if c["image"].startswith(name + ":") else None)
            c["image"] = f"{new}:{tag}" if tag else new


def _patch(objects: list[dict], p: dict) -> None:
    target = p.get("target", {})
    if set(p) != {"target", "patch"} or set(target) - TARGET_FIELDS:
        raise Unsupported(f"patch {p!r}: only an inline JSON 6902 patch with a target of {sorted(TARGET_FIELDS)}")
    hits = [o for o in objects if _matches(o, target)]
    if not hits:
        raise Unsupported(f"patch target {target} matches no object")
    ops = yaml.safe_load(p["patch"])
    for obj in hits:
        for op in ops:
            _apply(obj, op)


def _matches(obj: dict, target: dict) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    return (target.get("group", group) == group and target.get("version", version) == version
            and target.get("kind", obj["kind"]) == obj["kind"]
            and target.get("name", obj["metadata"]["name"]) == obj["metadata"]["name"])


def _apply(obj: dict, op: dict) -> None:
    """One JSON 6902 operation on ``obj`` in place."""
    *parents, last = [t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]]
    node = obj
    for token in parents:
        node = node[int(token)] if isinstance(node, list) else node[token]
    kind = op["op"]
    if kind not in ("add", "replace", "remove"):
        raise Unsupported(f"JSON patch op {kind!r}")
    if isinstance(node, list):
        if kind == "add":
            node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
        elif kind == "replace":
            node[int(last)] = copy.deepcopy(op["value"])
        else:
            del node[int(last)]
        return
    if kind != "add" and last not in node:
        raise Unsupported(f"JSON patch {kind} of {op['path']}: no such field")
    if kind == "remove":
        del node[last]
    else:
        node[last] = copy.deepcopy(op["value"])


def kubectl_build(folder: str | Path, timeout: float = 60.0) -> list[dict] | None:
    """``kubectl kustomize folder``'s objects, or None when kubectl is not on PATH."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=timeout,
                         check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]
