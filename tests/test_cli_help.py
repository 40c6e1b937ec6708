"""Every command line of the project explains each of its options: every module that builds an argparse parser
(found by reading the packages, so a new one is walked too: docgen.cli) is run up to its parse, whose
parser (and sub-parsers)
is then checked for an option without a help line; ``python -m worker_service --help`` lists every setting with its
meaning."""
from __future__ import annotations

import argparse

import pytest

from docgen.cli import cli_modules, parser_of  # the same walk renders docs/reference/cli*.md


def without_help(parser: argparse.ArgumentParser) -> list[str]:
    """The options and positionals of ``parser`` and its sub-parsers that have no help line."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {a.dest for a in action._choices_actions if a.help}
            out += [f"{parser.prog} {name}" for name in action.choices if name not in helped]
            for sub in action.choices.values():
                out += without_help(sub)
        elif not (action.help and action.help.strip()) and action.help != argparse.SUPPRESS:
            out.append(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}")
    return out


def test_the_walk_finds_the_command_lines():
    assert {"cluster.__main__", "ps_service.__main__", "syncps.__main__", "bench.run", "bench.modes",
            "docgen.__main__"} <= set(
        cli_modules())


@pytest.mark.parametrize("module", cli_modules())
def test_every_option_has_a_help_line(module):
    parser = parser_of(module)
    assert parser.prog.startswith("python "), f"{module}'s usage line names {parser.prog!r}, not its command"
    assert not without_help(parser), f"options without help: {without_help(parser)}"


def test_the_worker_lists_every_setting_with_its_meaning(capsys):
    from worker_service.__main__ import main
    from worker_service.settings import WorkerSettings

    assert main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, field in WorkerSettings.model_fields.items():
        row = next(line for line in lines if line.startswith(f"  WORKER_{name.upper()} "))  # the settings table
        assert field.description and field.description.strip()[:30] in row, name
