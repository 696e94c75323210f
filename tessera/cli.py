"""`tessera serve | generate | bench`: the command line."""

from __future__ import annotations

import argparse
import sys
import traceback

from tessera.config import ASSETS_DIR, ServerArgs

EXAMPLE_IMAGE = ASSETS_DIR / "examples" / "scene.png"
EXAMPLE_SPEECH = ASSETS_DIR / "examples" / "speech.wav"


def _check_media_before_loading(args: ServerArgs, given: dict[str, list[str]]) -> None:
    """What can be told without the model, in seconds rather than after it loads: a local file that is not
    there, media the model does not take."""
    import os

    from tessera.messages.items import Modality
    from tessera.models.config import ModelConfig
    from tessera.models.families import refuse_media

    for name, items in given.items():
        for item in items:
            if "://" not in item and not item.startswith("data:") and not os.path.isfile(item):
                raise ValueError(f"--{name} {item}: no such file")
            if name == "image" and os.path.isfile(item):
                from tessera.multimodal.media import looks_like_video

                with open(item, "rb") as f:
                    if looks_like_video(f.read(16)):
                        raise ValueError(f"--image {item}: it looks like a video; pass it with --video")
    served = ModelConfig.load(args.model_path, args.model_impl).family.served_modalities(args.language_model_only)
    refuse_media(args.model_name, served, [Modality(name) for name, items in given.items() if items],
                 args.language_model_only)


def _cmd_generate(ns: argparse.Namespace) -> int:
    from tessera.entrypoints.engine import Engine

    args = ServerArgs.from_cli_args(ns)
    kwargs = {k: v for k, v in vars(args).items() if k != "model_path"}
    kwargs["allowed_local_media_path"] = kwargs.get("allowed_local_media_path") or "/"
    images, videos, audios = ns.image or [], ns.video or [], ns.audio or []
    _check_media_before_loading(args, {"image": images, "video": videos, "audio": audios})
    with Engine(args.model_path, show_progress=False, **kwargs) as engine:
        info = engine.tokenizer_manager.info
        if not (images or videos or audios or ns.no_image):  # the bundled example the model understands
            if info.has_image_understanding:
                images = [str(EXAMPLE_IMAGE)]
            elif info.has_audio_understanding:
                audios = [str(EXAMPLE_SPEECH)]
        prompt_text = ns.prompt or ("Transcribe the audio." if audios and not images else "Describe the image.")
        content: list[dict] = ([{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos]
                               + [{"type": "audio"} for _ in audios])
        content.append({"type": "text", "text": prompt_text})
        prompt = engine.apply_chat_template([{"role": "user", "content": content}])
        sp = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature}
        for name, items in (("image", images), ("video", videos), ("audio", audios)):
            if items:
                print(f"{name}: {', '.join(items)}", file=sys.stderr)
        print(f"user: {prompt_text}", file=sys.stderr)
        out = engine.generate(prompt, sp, image_data=images or None, video_data=videos or None,
                              audio_data=audios or None)
        print(out["text"])
    return 0


def _cmd_serve(ns: argparse.Namespace) -> int:
    args = ServerArgs.from_cli_args(ns)
    if args.node_rank > 0:  # another node of a multi-node group: its tensor-parallel ranks only
        from tessera.distributed.tp_launch import run_node

        return run_node(args)
    from tessera.entrypoints.http_server import launch_server

    return launch_server(args)


def _cmd_bench(ns: argparse.Namespace) -> int:
    from tessera.bench.cli import run_bench

    return run_bench(ns.bench_args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tessera", description="Tessera: multimodal LLM serving engine")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                           description="Serve a model over an OpenAI-compatible HTTP API (and SGLang's /generate).")
    ServerArgs.add_cli_args(serve)
    serve.set_defaults(func=_cmd_serve)
    gen = sub.add_parser("generate", help="answer one prompt about an image, a video or audio (by default the "
                                          "bundled example the model understands)")
    one = gen.add_argument_group("Generate: the prompt and its media")
    one.add_argument("--prompt", default=None, help="the question (default: 'Describe the image.', or "
                                                    "'Transcribe the audio.' for audio)")
    one.add_argument("--image", action="append", help="image path or URL (repeatable)")
    one.add_argument("--video", action="append", help="video path or URL (repeatable)")
    one.add_argument("--audio", action="append", help="audio path or URL (repeatable; demo-asr: up to ~6 s "
                                                      "of speech each)")
    one.add_argument("--no-image", action="store_true", help="text only: no bundled example")
    one.add_argument("--max-new-tokens", type=int, default=64, help="(default: 64)")
    one.add_argument("--temperature", type=float, default=0.0, help="(default: 0.0, greedy)")
    ServerArgs.add_cli_args(gen)
    gen.set_defaults(func=_cmd_generate)
    # prefix_chars="+": no option is this parser's own, so `tessera bench --help` reaches tessera.bench.cli intact
    # (REMAINDER would not take a first argument that looks like an option).
    bench = sub.add_parser("bench", help="benchmarks: `tessera bench "
                                         "serving|offline|profile|soak|overload|spec|embed --help`",
                           add_help=False, prefix_chars="+")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    debug = str(getattr(ns, "log_level", "") or "").lower() == "debug"
    try:
        code = ns.func(ns)
    except KeyboardInterrupt:
        code = 130
    except Exception as e:  # noqa: BLE001 - every error is one line; --log-level debug shows the traceback
        if debug:
            traceback.print_exc()
        print(f"error: {one_line(e)}", file=sys.stderr)
        code = 2 if isinstance(e, ValueError) else 1
    sys.exit(code)


def one_line(e: BaseException) -> str:
    """The first line of the error's message; its type too unless it is a ValueError (our user errors)."""
    text = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, ValueError):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
