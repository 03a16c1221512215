#!/usr/bin/env bash
# Builds deepinfer_dp._C with AddressSanitizer and UndefinedBehaviorSanitizer in a build
# directory of its own (build/sanitize; the normal build is untouched) and runs the C++-heavy
# tests against it: scheduler, binding guards, KV capacity, kernels, a tiny-model engine, and
# the long scheduler fuzz (-m slow). Any sanitizer report aborts the run with its stack.
#
#   tools/sanitizer_build.sh              # build, then the tests below
#   tools/sanitizer_build.sh PYTEST_ARGS  # build, then pytest with these arguments instead
#
# Python itself is not instrumented, so libasan must be preloaded; libstdc++ is preloaded
# with it, or ASan's interceptor of __cxa_throw resolves to nothing and the first C++
# exception (a ValueError raised from C++) aborts the process.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build/sanitize
# The project's venv (launch/setup.sh) unless PYTHON names another interpreter.
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DPython_EXECUTABLE="$(command -v "$PY")" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" >/dev/null
cmake --build "$BUILD" -j "$(nproc)"

so=$(ls "$BUILD"/_C*.so)
export DEEPINFER_SANITIZED_CORE="$PWD/$so"
export LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)"
# Leak checking is off: the interpreter never frees its own objects at exit.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:strict_string_checks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export PYTHONPATH="$PWD/tools${PYTHONPATH:+:$PYTHONPATH}"
pytest() { "$PY" -m pytest -p sanitized_core -p no:cacheprovider "$@"; }

if [ $# -gt 0 ]; then
  pytest "$@"
  exit
fi
pytest -q -m "not slow" tests/engine/test_scheduler.py tests/engine/test_binding_guards.py \
  tests/engine/test_kv_capacity.py tests/engine/test_llm_engine.py tests/kernels -k "not serve and not server"
pytest -q -s -m slow tests/engine/test_scheduler_fuzz.py
echo "sanitizer run: no ASan/UBSan report"
