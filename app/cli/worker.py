"""`ngrammys worker`: a tensor-parallel rank other than 0 (`app/ranks.py`), with `serve`'s flags."""

from __future__ import annotations

import argparse
import logging
import sys

from app.cli.serve import add_flags, serve_settings

__all__ = ["add_flags", "run"]


def run(args: argparse.Namespace) -> None:
    from app.ranks import run_worker

    try:
        settings = serve_settings(args)
    except ValueError as error:
        sys.exit(f"ngrammys worker: {error}")
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_worker(settings)
