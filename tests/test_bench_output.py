"""The benches print a table for people by default and JSON lines with ``--json`` (bench/output.py): the table's
cells are the JSON fields' values, a wide result is turned, a bench run by another script (bench.ab's trees) gets
JSON lines from ``SYNCPS_BENCH_JSON=1``, and every script that parses a bench's lines asks for them."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from bench import output
from bench.output import Results, table
from tests.timing import allow

ROOT = Path(__file__).resolve().parents[1]


def rows(text: str) -> list[list[str]]:
    """A printed table's rows (the header first), split on runs of two spaces or more."""
    lines = [ln for ln in text.strip().splitlines() if not set(ln) <= {"-", " "}]
    return [re.split(r"\s{2,}", ln.strip()) for ln in lines]


def test_a_table_has_a_column_per_field_and_a_row_per_result():
    lines = [{"config": "sync", "steps_per_s": 12.3456789, "staleness": {"p50": 0, "p99": 1}, "series": [[0, 1]]},
             {"config": "async", "steps_per_s": 40.0, "error": None}]
    assert rows(table(lines)) == [["config", "steps_per_s", "staleness.p50", "staleness.p99", "error"],
                                  ["sync", "12.35", "0", "1", "-"], ["async", "40", "-", "-", "-"]]
    assert rows(table(lines, ["steps_per_s", "config"])) == [["steps_per_s", "config"], ["12.35", "sync"],
                                                             ["40", "async"]]
    assert table([]) == "(no results)"


def test_a_wide_result_is_turned_a_row_per_field():
    line = {f"f{i}": i for i in range(output.WIDE + 1)}
    assert rows(table([line, line])) == [["field", "1", "2"], *([f"f{i}", str(i), str(i)] for i in range(len(line)))]


def test_results_print_json_lines_at_once_or_one_table_at_the_end(capsys):
    with Results(True) as out:
        out.add({"a": 1})
        assert capsys.readouterr().out == '{"a": 1}\n'
    assert capsys.readouterr().out == ""
    with Results(False, prog="python -m bench.x") as out:
        out.add({"a": 1})
        got = capsys.readouterr()
        assert got.out == "" and got.err == "python -m bench.x: result 1 in\n"
    assert rows(capsys.readouterr().out) == [["a"], ["1"]]


def test_the_environment_asks_for_json_lines(monkeypatch):
    import argparse

    for env, want in (("1", True), ("", False)):
        monkeypatch.setenv(output.ENV, env)
        ap = argparse.ArgumentParser()
        output.add_json_option(ap)
        assert ap.parse_args([]).json is want and ap.parse_args(["--json"]).json is True


def test_a_real_bench_prints_the_same_numbers_in_both_forms():
    """bench.loopback (a second of CPU): its table's cells are its JSON line's fields, rounded as the table says."""
    run = lambda *a: subprocess.run([sys.executable, "-m", "bench.loopback", "--bytes", "2e6", *a], cwd=ROOT,  # noqa
                                    capture_output=True, text=True, timeout=allow(120))
    as_json, as_table = run("--json"), run()
    assert as_json.returncode == as_table.returncode == 0, as_json.stderr + as_table.stderr
    line = json.loads(as_json.stdout)
    head, values = rows(as_table.stdout)
    assert head == list(line) and values[0] == str(line["bytes"]) and as_table.stdout.count("\n") == 3


def test_bench_modes_tables_the_json_lines_of_an_earlier_run(tmp_path, capsys):
    from bench.modes import main

    runs = [{"config": "sync", "gradients_per_s": 100.0, "steps_per_s": 25.0, "held_out_accuracy": 0.9,
             "held_out_loss": 0.3, "staleness": {"p50": 0, "p90": 0, "p99": 0}, "max_clock_spread": None,
             "series": [[0.0, 2.3, 0.1]], "window_s": 20.0, "load_avg": 1.5},
            {"config": "ssp s=2", "gradients_per_s": 180.0, "steps_per_s": 180.0, "held_out_accuracy": 0.8,
             "held_out_loss": 0.5, "staleness": {"p50": 1, "p90": 2, "p99": 3}, "max_clock_spread": 2,
             "series": [[0.0, 2.3, 0.1]], "window_s": 20.0, "load_avg": 1.5}]
    saved = tmp_path / "modes.jsonl"
    saved.write_text("".join(json.dumps(r) + "\n" for r in runs))
    assert main(["--load", str(saved)]) == 0
    assert rows(capsys.readouterr().out) == [
        ["config", "gradients_per_s", "steps_per_s", "held_out_accuracy", "held_out_loss", "staleness.p50",
         "staleness.p99", "max_clock_spread", "window_s", "load_avg"],
        ["sync", "100", "25", "0.9", "0.3", "0", "0", "-", "20", "1.5"],
        ["ssp s=2", "180", "180", "0.8", "0.5", "1", "3", "2", "20", "1.5"]]
    assert main(["--load", str(saved), "--json"]) == 0
    assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == runs


def test_every_script_that_parses_a_bench_asks_for_json_lines():
    """A bench run as a subprocess whose lines are parsed (``json.loads`` of the lines starting with ``{``) is run with
    ``--json``, or with SYNCPS_BENCH_JSON=1 (bench.ab: its trees may predate the option)."""
    cmd = re.compile(r'"-m", "(bench\.\w+)"(.{0,40})')
    missing = []
    for path in [*ROOT.glob("bench/*.py"), *ROOT.glob("tests/*.py")]:
        if path.name == Path(__file__).name:  # this file runs a bench both ways
            continue
        text = path.read_text()
        for m in cmd.finditer(text):
            if m.group(1) in ("bench.table",) or "--json" in m.group(2):
                continue
            if not (path.name == "ab.py" and "output.ENV" in text):
                missing.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert not missing, missing
