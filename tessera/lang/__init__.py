"""tessera.lang: multi-call programs over a model, in the spirit of SGLang's frontend language.

A program appends chat turns, media and generation points to a state; each gen/select is one request to
an Engine or a server, whose prefix cache makes the shared conversation cheap. See the README's tour,
docs/features.md ("Programs") and examples/lang_*.py.
"""

from tessera.lang.backend import EngineBackend, RuntimeEndpoint
from tessera.lang.ir import assistant, audio, gen, image, select, system, user, video
from tessera.lang.program import Program, fork, function, run_batch, set_default_backend
from tessera.lang.state import ForkGroup, ProgramState

__all__ = ["EngineBackend", "ForkGroup", "Program", "ProgramState", "RuntimeEndpoint", "assistant", "audio", "fork",
           "function", "gen", "image", "run_batch", "select", "set_default_backend", "system", "user", "video"]
