#!/usr/bin/env bash
# Builds llama.cpp from llama-cpp-python's source distribution on PyPI (its vendored llama.cpp), for the side-by-side
# comparison in docs/benchmarks.md. Idempotent: each step is skipped when its output exists, so a killed build resumes.
# Usage: scripts/build_llamacpp.sh [ROOT]   (ROOT defaults to $LLAMACPP_ROOT or /work/llamacpp)
set -euo pipefail
ROOT=${1:-${LLAMACPP_ROOT:-/work/llamacpp}}
VERSION=${LLAMACPP_PY_VERSION:-0.3.36}
JOBS=${JOBS:-2}
PY=${PYTHON:-python3}
mkdir -p "$ROOT/src"
sdist=$(ls "$ROOT"/src/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)
if [ -z "$sdist" ]; then
  "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$ROOT/src"
  sdist=$(ls "$ROOT"/src/llama_cpp_python-"$VERSION".tar.gz)
fi
SRC="$ROOT/src/llama_cpp_python-$VERSION"
[ -d "$SRC/vendor/llama.cpp" ] || tar -xzf "$sdist" -C "$ROOT/src"
LLAMA="$SRC/vendor/llama.cpp"
ln -sfn "$LLAMA" "$ROOT/llama.cpp"
# The converter runs under $PY (it needs torch, numpy, safetensors, pyyaml, tqdm, which Tessera's venv has) and
# imports sentencepiece even for BPE tokenizers: that one goes to a side directory, not into $PY's environment.
[ -d "$ROOT/pydeps/sentencepiece" ] || "$PY" -m pip install -q --target "$ROOT/pydeps" sentencepiece
BUILD="$ROOT/build"
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  cmake -S "$LLAMA" -B "$BUILD" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
fi
cmake --build "$BUILD" -j "$JOBS" --target llama-bench llama-server llama-quantize
echo "built: $(ls "$BUILD"/bin)"
