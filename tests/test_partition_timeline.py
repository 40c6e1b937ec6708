"""The timeline of a partitioned step (shared/marks.py, bench/timeline.py): marks are off unless SYNCPS_MARKS_DIR is
set, and the timeline names each idle gap of a worker's downlink and the partition close it waited for."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import timeline
from tests.timing import allow

MS = 1_000_000


def write(path: Path, pid: int, marks: list[tuple[float, str, dict]]) -> None:
    path.write_text("".join(json.dumps({"t": int(t * MS), "pid": pid, "ev": ev, **f}) + "\n" for t, ev, f in marks))


def test_marks_are_off_by_default_and_one_json_line_each_when_on(tmp_path):
    code = ("from shared import marks; print(marks.ON)\n"
            "if marks.ON: marks.mark('step.push', step=3); marks.mark('step.pulled', step=3)")
    env = {k: v for k, v in os.environ.items() if k != "SYNCPS_MARKS_DIR"}
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=allow(60))
    assert off.stdout.strip() == "False"
    on = subprocess.run([sys.executable, "-c", code], env={**env, "SYNCPS_MARKS_DIR": str(tmp_path)},
                        capture_output=True, text=True, timeout=allow(60))
    assert on.stdout.strip() == "True"
    (f,) = tmp_path.glob("*.jsonl")
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    assert [x["ev"] for x in lines] == ["step.push", "step.pulled"]
    assert lines[1]["step"] == 3 and lines[1]["t"] >= lines[0]["t"] and lines[0]["pid"] == int(f.stem)


def test_a_mark_that_cannot_be_written_turns_marks_off_and_raises_nothing(tmp_path):
    """A timeline aid never fails what it traces: SYNCPS_MARKS_DIR naming a file (no directory can be made there), a
    mark warns once, turns marks off and returns (it raised into the PS's request before)."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    code = ("from shared import marks; print(marks.ON)\n"
            "marks.mark('step.push', step=3); print(marks.ON)\n"
            "if marks.ON: marks.mark('step.pulled', step=3)\nprint('went on')")
    env = {**os.environ, "SYNCPS_MARKS_DIR": str(blocked)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=allow(60))
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "False", "went", "on"]
    assert run.stderr.count("timeline marks off") == 1


def test_the_timeline_names_each_idle_gap_and_the_close_it_waited_for(tmp_path, capsys):
    """One worker, two shards: its downlink idles until shard 0's partition 0 closed (a frame of this worker), then
    between shard 0's frame and shard 1's, whose partition waited for its decision and this worker's frame."""
    write(tmp_path / "1.jsonl", 1, [
        (0, "step.push", {"step": 0, "worker": "w"}),
        (0, "push.start", {"shard": 0, "peer": "a:1", "step": 0}),
        (0, "push.start", {"shard": 1, "peer": "b:1", "step": 0}),
        (50, "http.sent", {"peer": "b:1", "target": "/v1/shard/gradients", "local": "c"}),
        (100, "chunk.first", {"peer": "a:1", "n": 10}), (150, "chunk.last", {"peer": "a:1", "n": 10}),
        (200, "chunk.first", {"peer": "b:1", "n": 10}), (260, "chunk.last", {"peer": "b:1", "n": 10}),
        (300, "step.pulled", {"step": 0})])
    write(tmp_path / "10.jsonl", 10, [
        (5, "body.wake", {"body": 7, "got": 10}), (80, "body.wake", {"body": 7, "got": 1000}),
        (81, "frame.in", {"body": 7, "q": 0, "end": 1000, "worker": "w", "step": 0}),
        (90, "part.close", {"q": 0, "step": 0}), (95, "pull.yield", {"q": 0, "step": 0, "peer": "c", "shard": 0})])
    write(tmp_path / "11.jsonl", 11, [
        (100, "body.wake", {"body": 7, "got": 500}), (180, "body.wake", {"body": 7, "got": 1500}),
        (185, "frame.in", {"body": 7, "q": 0, "end": 1000, "worker": "w", "step": 0}),
        (170, "decision.in", {"step": 0, "shard": 1}),
        (190, "part.close", {"q": 0, "step": 0}), (195, "pull.yield", {"q": 0, "step": 0, "peer": "c", "shard": 1})])
    assert timeline.main([str(tmp_path), "--skip", "0"]) == 0
    step, summary = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert step["step_ms"] == 300 and step["up"] == {"sent_ms": 50, "in_ms": 140, "detected_lag_ms": 45}
    down = step["down"]
    assert (down["first_ms"], down["last_ms"], down["busy_ms"]) == (100, 260, 110)
    first, second = down["gaps"]
    assert (first["from_ms"], first["to_ms"]) == (0, 100)
    assert first["next"] == {"shard": 0, "q": 0, "close_ms": 90, "by": "w", "arrived_ms": 80, "taken_ms": 81,
                             "decision_ms": None}
    assert (second["from_ms"], second["to_ms"]) == (150, 200)
    assert second["next"] == {"shard": 1, "q": 0, "close_ms": 190, "by": "w", "arrived_ms": 140, "taken_ms": 185,
                              "decision_ms": 170}
    assert summary["summary"]["down_idle_ms"] == 150 and summary["summary"]["model_link_ms"] == 426.7
