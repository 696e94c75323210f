"""How much of the code one image chat request crosses, and the package's longest functions.

Starts `tessera serve --model-path demo-vl` (warm-up included) with a profile hook in every Python process it
runs (the frontend and the scheduler, through a `sitecustomize` on PYTHONPATH), sends one non-streaming
`/v1/chat/completions` request with the example image, and counts the functions of `tessera/` whose call count
rose while it was answered: the files they are in (with those files' lines) and the functions' own lines.
The scheduler's idle loop runs meanwhile and is counted with it: it is on the request's path too.

    PYTHONPATH=. .venv/bin/python scripts/request_path.py [--list] [--json OUT]

docs/architecture.md ("One image chat request, step by step") walks the same path by hand.
"""

from __future__ import annotations

import argparse
import ast
import base64
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tessera"
IMAGE = PACKAGE / "assets" / "examples" / "scene.png"

# Loaded by every interpreter the server starts (the directory is first on PYTHONPATH). It counts calls of
# functions under TESSERA_TRACE_ROOT and, when the file `<dir>/snap-<name>` appears, writes its counts to
# `<dir>/<name>-<pid>.json`.
SITECUSTOMIZE = r'''
import collections, json, os, sys, threading, time
_dir, _root = os.environ.get("TESSERA_TRACE_DIR"), os.environ.get("TESSERA_TRACE_ROOT")
if _dir and _root:
    _counts = collections.Counter()

    def _profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(_root):
            _counts[frame.f_code] += 1

    def _snapshots():
        done = set()
        while True:
            for name in os.listdir(_dir):
                if name.startswith("snap-") and name not in done:
                    done.add(name)
                    rows = [[c.co_filename, c.co_qualname, c.co_firstlineno, n] for c, n in list(_counts.items())]
                    path = os.path.join(_dir, f"{name[5:]}-{os.getpid()}.json")
                    with open(path + ".tmp", "w") as f:
                        json.dump(rows, f)
                    os.replace(path + ".tmp", path)
            time.sleep(0.05)

    threading.Thread(target=_snapshots, daemon=True).start()
    sys.setprofile(_profile)
    threading.setprofile(_profile)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _snapshot(trace_dir: Path, name: str, num_procs: int) -> dict[tuple, int]:
    """The call counts of the server's `num_procs` processes, keyed by (file, qualified name, first line)."""
    (trace_dir / f"snap-{name}").touch()
    deadline = time.monotonic() + 30
    while len(list(trace_dir.glob(f"{name}-*.json"))) < num_procs:
        if time.monotonic() > deadline:
            raise SystemExit(f"fewer than {num_procs} processes answered the snapshot")
        time.sleep(0.1)
    counts: dict[tuple, int] = {}
    for path in trace_dir.glob(f"{name}-*.json"):
        for file, qualname, line, n in json.loads(path.read_text()):
            counts[file, qualname, line] = counts.get((file, qualname, line), 0) + n
    return counts


def _function_lines() -> dict[tuple[str, int], int]:
    """(file, first line) -> the function's length in lines, for every function in the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                out[str(path), first] = node.end_lineno - node.lineno + 1
                out[str(path), node.lineno] = node.end_lineno - node.lineno + 1
    return out


def longest_functions(n: int = 10) -> list[tuple[int, str]]:
    """The package's n longest functions: (lines, `file:Class.function`)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        todo: list[tuple[ast.AST, str]] = [(ast.parse(path.read_text()), f"{path.relative_to(ROOT)}:")]
        while todo:
            node, prefix = todo.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.append((child.end_lineno - child.lineno + 1, prefix + child.name))
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    todo.append((child, f"{prefix}{child.name}."))
    return sorted(found, reverse=True)[:n]


def measure(model: str, timeout_s: float) -> dict:
    trace_dir = Path(tempfile.mkdtemp(prefix="tessera-trace-"))
    (trace_dir / "site").mkdir()
    (trace_dir / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (trace_dir / "snaps").mkdir()
    env = dict(os.environ, TESSERA_TRACE_DIR=str(trace_dir / "snaps"), TESSERA_TRACE_ROOT=str(PACKAGE),
               PYTHONPATH=os.pathsep.join([str(trace_dir / "site"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "tessera", "serve", "--model-path", model,
                               "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited ({server.returncode})")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not become healthy")
            time.sleep(0.5)
        snaps = trace_dir / "snaps"
        (snaps / "snap-count").touch()  # how many processes the server runs: those that answer within 2 s
        time.sleep(2)
        num_procs = len(list(snaps.glob("count-*.json")))
        before = _snapshot(snaps, "before", num_procs)
        image = base64.b64encode(IMAGE.read_bytes()).decode()
        body = {"model": model, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
            {"type": "text", "text": "How many shapes are there?"}]}]}
        reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()
        after = _snapshot(snaps, "after", num_procs)
    finally:
        server.terminate()
        server.wait(timeout=30)
    # Comprehensions, lambdas and generator expressions are code objects of their own: counted in their function.
    crossed = sorted(k for k, n in after.items() if n > before.get(k, 0) and "<" not in k[1].rpartition(".")[2])
    lengths = _function_lines()
    files = sorted({file for file, _, _ in crossed})
    return {
        "processes": num_procs,
        "answer": reply["choices"][0]["message"]["content"],
        "num_files": len(files),
        "file_lines": sum(len(Path(f).read_text().splitlines()) for f in files),
        "num_functions": len(crossed),
        "function_lines": sum(lengths.get((f, line), 0) for f, _, line in crossed),
        "files": [str(Path(f).relative_to(ROOT)) for f in files],
        "functions": [f"{Path(f).relative_to(ROOT)}:{name}" for f, name, _ in crossed],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="demo-vl")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for the server to become healthy")
    ap.add_argument("--list", action="store_true", help="also print the files and functions crossed")
    ap.add_argument("--json", default=None, help="write the whole result here")
    args = ap.parse_args()
    result = measure(args.model_path, args.timeout)
    result["longest_functions"] = [f"{n} {name}" for n, name in longest_functions()]
    print(f"answer: {result['answer']!r}")
    print(f"crossed: {result['num_files']} files ({result['file_lines']} lines), "
          f"{result['num_functions']} functions ({result['function_lines']} lines)")
    print("longest functions:\n  " + "\n  ".join(result["longest_functions"]))
    if args.list:
        print("files:\n  " + "\n  ".join(result["files"]))
        print("functions:\n  " + "\n  ".join(result["functions"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
