"""``python -m docgen``: write the documentation pages rendered from the code; ``--check``: say which differ.

Pages (paths from the repository's root): docs/reference/configuration.md (the settings classes:
:mod:`docgen.configuration`), docs/reference/rest-api.md and rest-api-models.md (the PS's OpenAPI
schema: :mod:`docgen.rest_api`), docs/reference/cli.md (the product's commands) and cli-bench.md (the benches':
:mod:`docgen.cli`), and the results table of docs/performance.md, between its markers (:mod:`bench.report`: the
newest ``make bench`` pass in bench/results/), and README.md's short table of the same pass. Exit 0 when every page is as rendered (``--check``) or written; 1 with
the stale pages' names (``--check``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from docgen import cli, configuration, rest_api
from docgen.markdown import COMMAND, header

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("ps_service.__main__", "worker_service.__main__", "cluster.__main__", "syncps.__main__", "docgen.__main__")


def _cli_pages() -> dict[str, Callable[[], str]]:
    modules = cli.cli_modules()
    bench = [m for m in modules if m.startswith("bench.")]
    missing = sorted(set(modules) - set(bench) - set(PRODUCT))
    if missing:  # a new command outside bench: name it in PRODUCT, in the order of the page
        raise SystemExit(f"docgen: {missing} build a parser but are on no page (docgen/__main__.py, PRODUCT)")
    return {
        "docs/reference/cli.md": lambda: cli.page(
            "Command line", header("the commands' argparse parsers (docgen/cli.py)") + "\n\nThe product's commands. "
            "The benches' are in [the benchmarks' command line](cli-bench.md).", list(PRODUCT)),
        "docs/reference/cli-bench.md": lambda: cli.page(
            "Benchmarks' command line", header("the benches' argparse parsers (docgen/cli.py)") + "\n\nHow they "
            "measure and what their results mean: [Performance](../performance.md).", bench),
    }


def pages() -> dict[str, Callable[[], str]]:
    """Each generated page's path -> the function that renders its whole text from the code and its current text."""
    from bench import report

    spec = rest_api.schema()
    return {
        "docs/reference/rest-api.md": lambda: rest_api.page(spec, header("the PS's OpenAPI schema (docgen/rest_api.py)")),
        "docs/reference/rest-api-models.md": lambda: rest_api.models_page(
            spec, header("the PS's OpenAPI schema (docgen/rest_api.py)")),
        **_cli_pages(),
        configuration.PAGE: configuration.render,
        report.PAGE: lambda: report.render_page((ROOT / report.PAGE).read_text()),
        report.README: lambda: report.render_readme((ROOT / report.README).read_text()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing: exit 1 naming each page that differs from what the code renders")
    args = ap.parse_args(argv)
    stale = []
    for rel, render in pages().items():
        path = ROOT / rel
        text = render()
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(rel)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"docgen: wrote {rel}")
    if stale:
        print(f"docgen: these pages differ from what the code renders (run `{COMMAND}`): {', '.join(stale)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
