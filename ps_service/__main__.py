"""``python -m ps_service [--host H] [--port P]``: run a PS (other settings: PS_* env)."""
from __future__ import annotations

import argparse
import logging
import sys

import uvicorn
from pydantic import ValidationError

from ps_service.app import create_app, server_options
from ps_service.settings import PSSettings
from shared.settings_errors import settings_errors


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ps_service", description=__doc__)
    ap.add_argument("--host", help="bind address (default PS_HOST or 0.0.0.0)")
    ap.add_argument("--port", type=int, help="TCP port (default PS_PORT or 8000)")
    args = ap.parse_args(argv)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    try:
        settings = PSSettings(**overrides)
    except ValidationError as exc:
        sys.exit("".join(f"{ap.prog}: {line}\n" for line in settings_errors(exc, "PS_")))
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s ps %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a shard's links log their own failures, not every request
    # httptools with the body sink (server_options); the event loop: PS_EVENT_LOOP (docs/performance.md)
    app = create_app(settings, exit_on_refusal=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                timeout_graceful_shutdown=5, loop=settings.event_loop, **server_options(settings))


if __name__ == "__main__":
    main()
