"""``python -m bench.ledger PATH [PATH ...]``: one fast path's gain measured alone, for docs/performance.md's ledger.

Each fast path below is a place where the code does something cleverer than the plain way for speed. To measure
one alone, this exports the working tree's HEAD twice (``git archive``), takes the path out of one copy by a textual
edit of a few lines (each edit must match exactly once, or the run stops: the ledger's lines have moved), and runs
:mod:`bench.ab` with the plain copy as ``before`` and HEAD as ``after`` on the path's cells, ``--runs`` alternating
runs a side. It prints a table of one ``ledger`` row per cell (``--json``: bench.ab's lines, then one ``ledger``
line per cell): the medians, ``gain`` (after / before -
1) and ``noise`` (the larger half-spread, (max - min) / 2 / median, of the two sides); ``beyond_noise`` is
``|gain| > noise``. A path whose gain is not beyond the noise on any of its cells has not earned its place.

``--list`` prints the paths with their module and what taking them out means.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.output import Results, add_json_option

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class FastPath:
    where: str  # module (and what), for the ledger's row
    plain: str  # what the copy without it does instead
    edits: tuple[tuple[str, str, str], ...]  # (file, text, replacement): each text found exactly once
    cells: tuple[str, ...]  # bench.ab cells (transport:params:workers[:compression])


#: halves' plain casts of one encoding (``{0}``: fp16; ``{1}``: its dtype), defined after (so over) its own
_PLAIN_HALVES = """

def to_{0}(x):
    with np.errstate(all="ignore"):  # overflow to Inf, underflow to 0, a NaN: the cast's own
        return np.asarray(x, F32).astype({1})


def from_{0}(h, alloc=fresh):
    out = alloc(4 * h.size).view(F32).reshape(h.shape)
    out[...] = h
    return out
"""


def _plain_halves(name: str, dtype: str) -> tuple[tuple[str, str, str], ...]:
    end = "    return out.reshape(h.shape)\n"  # halves.py's last line
    return (("shared/halves.py", end, end + _PLAIN_HALVES.format(name, dtype)),)


PATHS: dict[str, FastPath] = {
    "hotpath": FastPath(
        "ps_service/hotpath.py (the fast lane: per-step push and pull without FastAPI's routing)",
        "every request through FastAPI's router",
        (("ps_service/app.py", "    app.add_middleware(HotPath)", "    pass  # ledger: no fast lane"),),
        ("http:1000:2", "shm:1000:2", "http:1000000:2")),
    "bodysink": FastPath(
        "ps_service/transport/bodysink.py (uvicorn's protocol reading large bodies straight into the route's buffer)",
        "uvicorn's httptools protocol; the body copied from its chunks",
        (("ps_service/app.py", '"http": BufferedSinkProtocol, ', ""),),
        ("http:1000000:2", "http:10000000:2")),
    "rawhttp": FastPath(
        "shared/rawhttp.py (the worker's HTTP/1.1 connection: sendmsg, recv_into)",
        "httpx for every URL",
        (("worker_service/transport/endpoint.py",
          'return RawConnection(base_url) if base_url.startswith("http://") else HttpxConnection(base_url)',
          "return HttpxConnection(base_url)"),),
        ("http:1000:2", "http:1000000:2", "http:10000000:2")),
    "halves-fp16": FastPath(
        "shared/halves.py's to_fp16 and from_fp16 (a branchless rounding in float32 arithmetic; a table's gather)",
        "numpy's casts: astype(float16), the widening an assignment",
        _plain_halves("fp16", "F16"), ("http:1000000:2:fp16",)),
    "topk-prune": FastPath(
        "shared/compression.py's top_k (candidates at or above a magnitude estimated from a strided sample)",
        "one argpartition of the whole tensor's magnitudes",
        (("shared/compression.py", "    if n > 8 * _SAMPLE and k * 64 < n:", "    if False:"),),
        ("http:1000000:2:topk",)),
    "shard-kept": FastPath(
        "worker_service/transport/sharded.py's _target (split tensors reassembled into one of two kept sets)",
        "fresh memory for every step's split tensors (shards.split_memory)",
        (("worker_service/transport/sharded.py", "        for kept in self._kept:\n",
          "        for kept in ():\n"),),
        ("http:10000000:2:S2",)),
    "into-file": FastPath(
        "worker_service/loop.py's gradient_buffers (a task that takes out computes into the same-host gradient file)",
        "every task computes into its own arrays; the push copies them into the file",
        (("worker_service/loop.py", "into = client.tensors.gradient_buffers() if into_buffers else None",
          "into = None"),),
        ("shm:1000000:2", "shm:10000000:2")),
    "pool": FastPath(
        "ps_service/core/buffers.py's BufferPool (bodies, same-host copies and frames in kept buffers, not faulted in)",
        "fresh memory for every buffer",
        (("ps_service/core/buffers.py", "        for buf in self._kept:\n", "        for buf in ():\n"),),
        ("http:1000000:2", "shm:10000000:2")),
    "recv-pool": FastPath(
        "shared/rawhttp.py's _buffer (a large answer received into one of two kept arrays no earlier answer views)",
        "fresh memory for every large answer",
        (("shared/rawhttp.py", "        for i in range(len(self._pool)):  # (not enumerate: its cached tuple holds the array, "
          "never free then)\n", "        for i in ():\n"),),
        ("http:1000000:2", "http:10000000:2")),
    "held-in-place": FastPath(
        "worker_service/transport/http.py's HeldWeights._apply (a delta written into held tensors nothing else views)",
        "every tensor of a delta answer copied",
        (("worker_service/transport/http.py", "                if wire.size and not refs.free(target):",
          "                if wire.size:"),
         ("worker_service/transport/http.py",
          "            elif refs.free(target):  # copied in: a view would keep this answer's whole buffer for one small "
          "tensor", "            elif False:")),
        ("http:1000000:2:topk",)),
    "sgd-entries": FastPath(
        "ps_service/core/optimizers.py's _sgd_entries (TF1's SGD of a top-k sum's entries only, in O(k))",
        "the sum made dense and the whole tensor updated",
        (("ps_service/core/optimizers.py", "                if stepped and g.dtype == w.dtype and w.flags.c_contiguous:",
          "                if False:"),),
        ("http:1000000:2:topk",)),
    "weight-deltas": FastPath(
        "ps_service/transport/deltas.py (a worker holding the previous step answered with the entries that changed)",
        "every answer dense",
        (("ps_service/transport/__init__.py",
          "        self.deltas = (WeightDeltas(self.compression.compresses) if settings.weight_deltas and",
          "        self.deltas = (WeightDeltas(self.compression.compresses) if False and"),),
        ("http:1000000:2:topk",)),
    "2bit-chunks": FastPath(
        "shared/compression.py's quantize_2bit (a gradient's codes and residual chunk by chunk, in the cache)",
        "the whole tensor at once",
        (("shared/compression.py",
          "    for lo, hi in scan.ranges(flat.size):  # a chunk starts on a word; the last word's codes past it are zero",
          "    for lo, hi in ((0, flat.size),):"),),
        ("http:1000000:2:2bit",)),
    "answer-frame": FastPath(
        "ps_service/core/model.py's WeightsStore (the weights kept in the dense answer's frame, copied when they change "
        "while an answer sends it)",
        "every dense answer's frame encoded for it from the weights",
        (("ps_service/transport/__init__.py", '        if form == "dense":\n', "        if False:\n"),),
        ("http:1000000:2", "http:10000000:2")),
    "2bit-decode": FastPath(
        "shared/compression.py's dequantize_2bit (code 0b01 told word-wide; a byte's 4 values in one 16-byte gather)",
        "each element's code unpacked (a byte each), checked and gathered one value at a time",
        (("shared/compression.py", "    t = wire >> 1", "    codes = ((octets[:, None] >> _SHIFTS) & 3).reshape(-1)"),
         ("shared/compression.py", "    np.invert(t, out=t)", "    pass"),
         ("shared/compression.py", "    np.bitwise_and(t, wire, out=t)\n", ""),
         ("shared/compression.py", "np.bitwise_and(t, _LOW_BITS, out=t).any()", "(codes == 1).any()"),
         ("shared/compression.py", '    values = np.take(table, octets, out=out, mode="clip").view(F32)',
          '    values = np.take(np.array([0, 0, -threshold, threshold], F32), codes, out=out.view(F32), mode="clip")')),
        ("http:1000000:2:2bit",)),
}


def export(tree: Path) -> None:
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True, timeout=120)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True, timeout=120)


def take_out(tree: Path, path: FastPath) -> None:
    for file, text, replacement in path.edits:
        target = tree / file
        source = target.read_text()
        if source.count(text) != 1:
            raise SystemExit(f"ledger: {file} holds {source.count(text)} copies of {text!r}: update bench/ledger.py")
        target.write_text(source.replace(text, replacement))


def verdict(name: str, cell: str, before: dict, after: dict) -> dict:
    gain = after["median"] / before["median"] - 1
    noise = max((s["max"] - s["min"]) / 2 / s["median"] for s in (before, after))
    return {"ledger": name, "cell": cell, "before": before["median"], "after": after["median"],
            "gain": round(gain, 4), "noise": round(noise, 4), "beyond_noise": abs(gain) > noise,
            "machine": after.get("machine"), "load": after.get("load")}


def measure(name: str, runs: int, seconds: float, out: Results) -> list[dict]:
    """bench.ab's lines of one path (printed with --json) and its verdicts (``out``), one per cell."""
    path = PATHS[name]
    with tempfile.TemporaryDirectory(prefix=f"syncps-ledger-{name}-") as tmp:
        plain, head = Path(tmp) / "plain", Path(tmp) / "head"
        export(plain)
        export(head)
        take_out(plain, path)
        done = subprocess.run([sys.executable, "-m", "bench.ab", str(plain), str(head), "--json", "--runs", str(runs),
                              "--seconds", str(seconds), "--cells", ",".join(path.cells)],
                             cwd=ROOT, capture_output=True, text=True, timeout=len(path.cells) * runs * 2 * (seconds + 300))
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    for line in lines if out.as_json else []:
        print(json.dumps({"path": name, **line}), flush=True)
    verdicts = []
    for cell in path.cells:
        sides = {s["side"]: s for s in lines if s.get("summary") == cell and "median" in s}
        if len(sides) == 2:
            verdicts.append(verdict(name, cell, sides["before"], sides["after"]))
            out.add(verdicts[-1])
    return verdicts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ledger", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", help=f"fast paths to measure: {', '.join(PATHS)}")
    ap.add_argument("--runs", type=int, default=5, help="alternating runs a side per cell (default 5)")
    ap.add_argument("--seconds", type=float, default=6.0, help="measured seconds of each run (default 6)")
    ap.add_argument("--list", action="store_true", help="list the fast paths and what taking each out means")
    add_json_option(ap)
    args = ap.parse_args(argv)
    if args.list or not args.paths:
        for name, p in PATHS.items():
            print(f"{name:11} {p.where}\n{'':11} without it: {p.plain}; cells {', '.join(p.cells)}")
        return 0
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown:
        ap.error(f"unknown paths {unknown}; --list shows them")
    with Results(args.json, prog=ap.prog) as out:
        for name in args.paths:
            measure(name, args.runs, args.seconds, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
