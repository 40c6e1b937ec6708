"""``python -m syncps export``: write a syncps model as a file your framework loads (syncps/export.py).

    python -m syncps export --url http://localhost:8000 --out model.safetensors
    python -m syncps export --checkpoint /checkpoints --format torch --out model.pt

Exits 0 after one line saying what it wrote; 1 with one line when there is nothing to export (no PS answering, a
refusal, no valid checkpoint); 2 on a wrong command line.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from syncps.export import WRITERS, ExportError, from_checkpoint, from_ps

SUFFIX = {"safetensors": ".safetensors", "torch": ".pt"}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m syncps", description=__doc__.split("\n\n")[0].strip("`"))
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ex = sub.add_parser("export", help="write the PS's or a checkpoint's weights as safetensors or a torch state_dict",
                        description="Write the weights of a running PS (--url) or of a checkpoint (--checkpoint) to "
                                    "a file: safetensors (numpy, PyTorch, JAX, TensorFlow read it) or a PyTorch "
                                    "state_dict (torch.load, then module.load_state_dict).")
    src = ex.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running PS (its coordinator, when sharded): its current weights, pulled once "
                                   "training has started")
    src.add_argument("--checkpoint", metavar="PATH",
                     help="a checkpoint file (ckpt-*.msgpack), or a PS_CHECKPOINT_DIR: its newest valid checkpoint")
    ex.add_argument("--out", metavar="FILE", help="the file to write (default model.safetensors, or model.pt "
                                                   "with --format torch); replaced whole if it exists")
    ex.add_argument("--format", choices=list(WRITERS), default="safetensors",
                    help="safetensors (default) or torch (torch.save of a state_dict; needs PyTorch)")
    ex.add_argument("--token-file", metavar="FILE", type=Path,
                    help="a file holding the PS's PS_AUTH_TOKEN (the training token: the pull is a training route)")
    ex.add_argument("--wait", type=float, default=30.0, metavar="SECONDS",
                    help="with --url: how long to wait for the PS to start training (default 30)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    out = Path(args.out or "model" + SUFFIX[args.format])
    try:
        token = args.token_file.read_text().strip() if args.token_file else None
    except OSError as exc:
        ap.error(f"--token-file {args.token_file}: {exc.strerror}")
    try:
        model = from_ps(args.url, token, args.wait) if args.url else from_checkpoint(args.checkpoint)
        size = WRITERS[args.format](out, model)
    except ExportError as exc:
        print(f"python -m syncps export: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"python -m syncps export: cannot write {out}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"wrote {out}: {len(model.tensors)} tensors, {size:,} bytes, {args.format}, global step {model.step} "
          f"(from {model.source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
