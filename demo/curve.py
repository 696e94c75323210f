"""Prints a training log (the work dir's log.json) as a markdown table, for docs/demo-*-training.md.

    python -m demo.curve .train/demo-asr/log.json [--columns step minutes exact ...]
"""

from __future__ import annotations

import argparse
import json


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [("" if r.get(c) is None else f"{r[c]:.2f}" if isinstance(r[c], float) and c != "minutes"
                  else str(r[c])) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--columns", nargs="+", default=None)
    args = ap.parse_args()
    with open(args.log) as f:
        print(table(json.load(f), args.columns))


if __name__ == "__main__":
    main()
