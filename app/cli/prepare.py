"""`ngrammys prepare`: read the model (a GGUF's config and tokenizer) and compute its tables
into the cache `serve` will read (an image bakes them); when the quantization resolves to gguf,
also the packed tiles and the compiled numba kernels (`<cache>/numba`), so a server with the
same settings starts without compiling."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from app.settings import Settings
from service.kernels.packed_linear import QUANTIZATIONS


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="model directory or .gguf [env NGRAMMYS_MODEL; default: embedded]",
    )
    parser.add_argument("--device", default=None, help="[env NGRAMMYS_DEVICE]")
    parser.add_argument(
        "--dtype",
        default=None,
        help="the dtype `serve` will use: the tables are keyed by it [env NGRAMMYS_DTYPE]",
    )
    parser.add_argument(
        "--quantization",
        choices=("auto", *QUANTIZATIONS),
        default=None,
        help="the quantization `serve` will use: gguf also bakes the packed tiles and "
        "compiles the numba kernels [env NGRAMMYS_QUANTIZATION; default: auto]",
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help="[env NGRAMMYS_CACHE_DIR]")


def run(args: argparse.Namespace) -> None:
    from service.model.loader import load_model
    from service.model.prompts import assistant_prefix_ids
    from service.model.tables import load_or_compute_tables

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    env = Settings()  # unset flags fall back to NGRAMMYS_*, as `serve` reads them
    model, device, dtype = (
        args.model or env.model,
        args.device or env.device,
        args.dtype or env.dtype,
    )
    cache_dir, quantization = args.cache_dir or env.cache_dir, args.quantization or env.quantization
    loaded = load_model(model, device, dtype, cache_dir, quantization)
    before = set((cache_dir / "tables").glob("*.npz"))
    load_or_compute_tables(
        loaded.model, cache_dir, assistant_prefix_ids(loaded.tokenizer), show_progress=False
    )
    tables = "computed" if set((cache_dir / "tables").glob("*.npz")) - before else "cached"
    print(
        f"{loaded.name} ({loaded.model.dtype}) in {cache_dir}: model "
        f"{'cached' if loaded.from_cache else 'read'}, tables {tables}",
        flush=True,
    )
