"""Shared by the examples: the backend from the command line (a server URL, or an Engine on demo-vl)."""

from __future__ import annotations

import argparse
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "tessera" / "assets" / "examples"
IMAGE = str(EXAMPLES / "scene.png")
VIDEO = str(EXAMPLES / "moving.mp4")


def run(main) -> None:
    """`python examples/X.py` runs main on an Engine with demo-vl; `--url http://127.0.0.1:30000` on a server."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", help="a running `tessera serve` (default: an in-process Engine)")
    parser.add_argument("--model-path", default="demo-vl")
    args = parser.parse_args()
    if args.url:
        print(main(args.url))
        return
    import tessera

    with tessera.Engine(args.model_path, show_progress=False) as engine:
        print(main(engine))
