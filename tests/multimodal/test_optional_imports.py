"""PyAV (`av`) and soundfile are needed only to decode video and audio: with both missing, tessera
imports, serves images, and a video decode is refused with a MediaError naming the package to install.

Each check runs in a fresh interpreter where `sys.modules[name] = None` makes `import name` fail."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "tessera" / "assets" / "examples"


def run_without(blocked: tuple[str, ...], body: str) -> dict:
    """Run `body` (which sets `result`, a JSON-able dict) with the `blocked` modules unimportable."""
    script = "import json, sys\n"
    script += "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    script += textwrap.dedent(body)
    script += "\nprint('RESULT ' + json.dumps(result))\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_images_need_neither_av_nor_soundfile():
    result = run_without(("av", "soundfile"), f"""
        import tessera
        import tessera.multimodal.media as media
        import tessera.multimodal.processors.qwen_vl
        import tessera.entrypoints.http_server
        import tessera.demo.speech, tessera.demo.examples, tessera.bench.datasets
        from transformers import AutoConfig, AutoProcessor
        from tests.multimodal.processor_registry import create_processor

        limits = media.MediaLimits.offline()
        image = media.load_image({str(EXAMPLES / "scene.png")!r}, limits=limits)

        model = {str(ROOT / "tessera" / "assets" / "demo-vl")!r}  # the image path a server takes, minus the model
        proc = create_processor(AutoProcessor.from_pretrained(model), AutoConfig.from_pretrained(model), limits=limits)
        prompt = "<|vision_start|><|image_pad|><|vision_end|>How many shapes are there?"
        out = proc.process(prompt, image_data={str(EXAMPLES / "scene.png")!r})
        proc.close()

        errors = {{}}
        for kind, load in (("video", lambda: media.load_video({str(EXAMPLES / "moving.mp4")!r}, limits=limits)),
                           ("audio", lambda: media.load_audio({str(EXAMPLES / "speech.wav")!r}, limits=limits,
                                                              sampling_rate=16000))):
            try:
                load()
                errors[kind] = None
            except media.MediaError as e:
                errors[kind] = [str(e), e.status]
        result = {{"image": [image.mode, image.size], "items": len(out.mm_inputs.items), "errors": errors,
                  "loaded": sorted(m for m in ("av", "soundfile") if sys.modules.get(m) is not None)}}
    """)
    assert result["image"] == ["RGB", [320, 240]]
    assert result["items"] == 1
    assert result["loaded"] == []
    for kind in ("video", "audio"):
        message, status = result["errors"][kind]
        assert "PyAV" in message and "pip install av" in message and status == 501, (kind, message)
    assert result["errors"]["video"][0].startswith("decoding a video needs PyAV")


def test_audio_without_soundfile_decodes_with_pyav():
    result = run_without(("soundfile",), f"""
        import numpy as np
        import tessera.multimodal.media as media

        limits = media.MediaLimits.offline()
        x = media.load_audio({str(EXAMPLES / "speech.wav")!r}, limits=limits, sampling_rate=16000)
        clip = media.load_video({str(EXAMPLES / "moving.mp4")!r}, limits=limits)
        result = {{"samples": x.tolist(), "frames": len(clip.frames)}}
    """)
    from tessera.multimodal.media import MediaLimits, load_audio

    reference = load_audio(str(EXAMPLES / "speech.wav"), limits=MediaLimits.offline(), sampling_rate=16000)  # soundfile
    assert len(result["samples"]) == len(reference) > 16000
    assert np.allclose(result["samples"], reference, atol=1e-4)
    assert result["frames"] > 0
