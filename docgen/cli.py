"""The command-line reference: every ``python -m`` command's parser, rendered as Markdown.

Contract:

- :func:`cli_modules` finds the commands by reading the packages: every module whose text builds an argparse
  parser; :data:`HELP_TEXT` adds ``worker_service.__main__`` (settings from the environment, no parser). A new
  command is documented (and its options checked for help lines by tests/test_cli_help.py) without a list to edit.
- :func:`parser_of` calls the module's ``main`` and stops it as it starts to parse (``parse_known_args`` raises):
  nothing of ``main`` after building the parser runs.
- :func:`page` renders the commands of the given modules: each command's description, its usage line, a table
  of its options (flags, default, meaning) and the same for each sub-command; the worker's own ``--help`` text.
  The rendering depends only on the parsers (a fixed 100-column width; a default under this checkout or the
  temporary folder shown as ``<checkout>`` or ``$TMPDIR``), so it is the same on every machine.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import os
import tempfile
from pathlib import Path
from unittest import mock

from docgen.markdown import cell, prose, slug

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ps_service", "worker_service", "shared", "syncps", "cluster", "bench", "docgen")
#: commands with no argparse parser: their ``main(["--help"])`` text is the reference
HELP_TEXT = ("worker_service.__main__",)
WIDTH = "100"
#: what a module that builds a parser contains (spelt so that this module does not)
BUILDS = "ArgumentParser" + "("


def cli_modules() -> list[str]:
    """Every module that builds an argparse parser, sorted by name."""
    return sorted(p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
                  for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if BUILDS in p.read_text())


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of(module: str) -> argparse.ArgumentParser:
    """The parser ``module.main`` builds, caught as it starts to parse."""
    def caught(self, *args, **kwargs):
        raise _Parsed(self)

    main = importlib.import_module(module).main
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", caught):
        try:
            main([]) if inspect.signature(main).parameters else main()
        except _Parsed as got:
            return got.parser
    raise RuntimeError(f"{module}.main returned without parsing its command line")


def command(module: str) -> str:
    """``python -m X`` of a module (``X`` without ``.__main__``)."""
    return "python -m " + module.removesuffix(".__main__")


#: a default that names this machine's paths is shown as where it points: the same page on every machine
PLACES = ((str(ROOT), "<checkout>"), (str(ROOT.parent), "<checkout>/.."), (tempfile.gettempdir(), "$TMPDIR"))


def _default(action: argparse.Action) -> str:
    if action.default in (None, argparse.SUPPRESS) or isinstance(action, (argparse._HelpAction,
                                                                          argparse._VersionAction)):
        return ""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "on" if action.default else "off"
    if action.default == "":
        return "`''`"
    text = repr(action.default)
    for real, shown in PLACES:
        text = text.replace(real, shown)
    return f"`{text}`"


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    name = ", ".join(f"`{s}`" for s in action.option_strings)
    if action.nargs != 0:
        metavar = action.metavar or (action.dest.upper() if action.choices is None
                                     else "{" + ",".join(map(str, action.choices)) + "}")
        name += f" `{metavar}`" if not isinstance(metavar, tuple) else f" `{' '.join(metavar)}`"
    return name


def _options(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
            continue
        meaning = formatter._expand_help(action) if action.help else ""
        rows.append(f"| {_flags(action)} | {_default(action)} | {cell(meaning)} |")
    return rows


def _usage(parser: argparse.ArgumentParser) -> str:
    with mock.patch.dict(os.environ, {"COLUMNS": WIDTH}):
        return parser.format_usage().strip()


def _section(parser: argparse.ArgumentParser, level: int, title: str) -> list[str]:
    out = [f"{'#' * level} `{title}`", ""]
    if parser.description:
        out += [prose(parser.description), ""]
    out += ["```text", _usage(parser), "```", "", *_options(parser), ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                if helps.get(name) and not sub.description:
                    sub.description = helps[name]
                out += _section(sub, level + 1, f"{title} {name}")
    return out


def help_text(module: str) -> str:
    """``main(["--help"])``'s printed text, at the fixed width."""
    buf = io.StringIO()
    with mock.patch.dict(os.environ, {"COLUMNS": WIDTH}), contextlib.redirect_stdout(buf):
        importlib.import_module(module).main(["--help"])
    return buf.getvalue().rstrip()


def page(title: str, intro: str, modules: list[str]) -> str:
    """The commands of ``modules`` on one page, as their parsers are built with no bench setting in the environment
    (``SYNCPS_BENCH_JSON`` would turn their ``--json`` default on)."""
    env = {k: v for k, v in os.environ.items() if k != "SYNCPS_BENCH_JSON"}
    with mock.patch.dict(os.environ, env, clear=True):
        return _page(title, intro, modules)


def _page(title: str, intro: str, modules: list[str]) -> str:
    out = [f"# {title}", "", intro, ""]
    out += [f"- [`{command(m)}`](#{slug(command(m))})" for m in modules] + [""]
    for m in modules:
        if m in HELP_TEXT:
            out += [f"## `{command(m)}`", "", "Its settings are environment variables; `--help` prints them:", "",
                    "```text", help_text(m), "```", ""]
        else:
            out += _section(parser_of(m), 2, command(m))
    return "\n".join(out).rstrip() + "\n"
