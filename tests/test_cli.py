"""The `tessera` command line: help, and clear errors (no tracebacks) for bad input."""

from __future__ import annotations

import subprocess

import pytest

from tests import warm_spawn


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return warm_spawn.run("tessera", args, timeout)


def test_help_lists_subcommands() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for sub in ("serve", "generate", "bench"):
        assert sub in out.stdout
    from tessera.bench.cli import SUBCOMMANDS

    for bench in SUBCOMMANDS:  # every benchmark is named, not only the first two
        assert bench in out.stdout, bench


@pytest.mark.parametrize("sub", ["serve", "generate"])
def test_subcommand_help(sub: str) -> None:
    out = run_cli(sub, "--help")
    assert out.returncode == 0 and "--model-path" in out.stdout


def test_unknown_model_path_is_a_clear_error(tmp_path) -> None:
    out = run_cli("generate", "--model-path", str(tmp_path / "nope"))
    assert out.returncode == 2
    assert "model_path" in out.stderr and "Traceback" not in out.stderr


def test_unreadable_image_is_a_clear_error(tmp_path) -> None:
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"this is not a png")
    out = run_cli("generate", "--image", str(bad), "--max-new-tokens", "4")
    assert out.returncode == 2, out.stderr
    assert "image" in out.stderr.lower() and "Traceback" not in out.stderr


def test_generate_answers_about_the_bundled_image() -> None:
    out = run_cli("generate", "--prompt", "How many shapes are there?", "--max-new-tokens", "8")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "three"


def test_serve_exits_with_one_line_when_the_model_fails_to_load(tmp_path) -> None:
    """Weights that do not match: `tessera serve` stops within seconds, exit 2, one error line, no traceback."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tessera.config import ASSETS_DIR
    from tests.server.server_process import free_port

    broken = tmp_path / "broken"
    shutil.copytree(ASSETS_DIR / "demo-vl", broken)
    weights = load_file(broken / "model.safetensors")
    weights.pop(next(k for k in weights if k.endswith("down_proj.weight")))
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    out = run_cli("serve", "--model-path", str(broken), "--port", str(free_port()), timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model failed to load: WeightLoadError" in errors[0]


def test_any_error_is_one_line_unless_debug(monkeypatch, capsys) -> None:
    """A chained RuntimeError from deep inside prints one `error:` line (exit 1); --log-level debug adds the
    traceback."""
    from tessera import cli

    def explode(ns):
        try:
            raise KeyError("inner")
        except KeyError as e:
            raise RuntimeError("scheduler step failed\nsecond line") from e

    monkeypatch.setattr(cli, "_cmd_generate", explode)
    for level, traceback_shown in (("info", False), ("debug", True)):
        with pytest.raises(SystemExit) as info:
            cli.main(["generate", "--log-level", level])
        err = capsys.readouterr().err
        assert info.value.code == 1
        assert [line for line in err.splitlines() if line.startswith("error:")] == [
            "error: RuntimeError: scheduler step failed"]
        assert ("Traceback" in err) is traceback_shown
        if not traceback_shown:
            assert len(err.strip().splitlines()) == 1


def test_serve_help_groups_every_flag_with_a_description() -> None:
    import dataclasses

    from tessera.cli import build_parser
    from tessera.config import ServerArgs
    from tessera.server_flags import FLAGS, GROUPS

    missing = [f.name for f in dataclasses.fields(ServerArgs) if f.name not in FLAGS]
    assert not missing, f"add these ServerArgs fields to tessera/server_flags.py FLAGS: {missing}"
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    titles = [g.title for g in serve._action_groups]
    for title in GROUPS.values():
        assert title in titles
    for action in serve._actions:
        if action.help is argparse_suppress() or action.dest == "help":
            continue
        assert action.help, action.dest
        if action.default not in (None, "") and not isinstance(action.default, dict):
            assert "default:" in action.help, action.dest


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


@pytest.mark.parametrize("argv, expected", [
    ([], True), (["--enable-metrics"], True), (["--enable-metrics", "false"], False),
    (["--enable-metrics=0"], False), (["--enable-metrics", "off"], False), (["--no-enable-metrics"], False),
    (["--enable-metrics", "YES"], True),
])
def test_boolean_flags_take_the_forms_people_type(argv, expected) -> None:
    from tessera.cli import build_parser

    ns = build_parser().parse_args(["serve", *argv, "--disable-radix-cache"])
    assert ns.enable_metrics is expected and ns.disable_radix_cache is True


def test_a_bad_boolean_is_a_usage_error(capsys) -> None:
    from tessera.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--enable-metrics", "maybe"])
    assert info.value.code == 2 and "invalid boolean value" in capsys.readouterr().err


def test_serve_on_a_port_in_use_is_one_line_before_loading() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = run_cli("serve", "--port", str(s.getsockname()[1]), timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: port: cannot listen on 127.0.0.1:")
    assert "Traceback" not in out.stderr and "loading" not in out.stderr


@pytest.mark.parametrize("argv", [["--allowed-media-domains", "a.com", "*.b.org"],
                                  ["--allowed-media-domains", "a.com,*.b.org"]])
def test_allowed_media_domains_in_both_forms(argv) -> None:
    from tessera.cli import build_parser
    from tessera.config import ServerArgs

    args = ServerArgs.from_cli_args(build_parser().parse_args(["serve", *argv]))
    assert args.allowed_media_domains == ("a.com", "*.b.org")


@pytest.mark.parametrize(("argv", "message"), [
    (["--image", "/nope.png"], "error: --image /nope.png: no such file"),
    (["--model-path", "demo-asr", "--image", "tessera/assets/examples/scene.png"],
     "error: media: demo-asr takes audio (and text), not images"),
    (["--model-path", "demo-vl", "--audio", "tessera/assets/examples/speech.wav"],
     "error: media: demo-vl takes image and video (and text), not audios"),
])
def test_generate_checks_its_media_before_the_model_loads(argv, message) -> None:
    out = run_cli("generate", *argv, timeout=60)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == message, out.stderr[-2000:]
    assert "Loading" not in out.stderr and "weights" not in out.stderr  # nothing was loaded first


def test_a_server_whose_warm_up_fails_exits_with_the_reason_instead_of_saying_it_is_ready() -> None:
    """--max-total-tokens 50 fits no chat prompt: every request would be refused, so the server does not start."""
    from tests.server.server_process import free_port

    out = run_cli("serve", "--port", str(free_port()), "--max-total-tokens", "50", timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the server could not answer its own warm-up request") and \
        "--max-total-tokens" in last, last
    assert "ready" not in out.stdout and "listening" not in out.stdout + out.stderr
    assert "Traceback" not in out.stderr
