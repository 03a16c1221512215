"""pytest plugin used by tools/sanitizer_build.sh: imports deepinfer_dp._C from the sanitizer
build named by $DEEPINFER_SANITIZED_CORE instead of the installed one.

Loaded with `-p sanitized_core` (tools/ on PYTHONPATH), so the finder is in place before any
test or conftest imports the package; the report header shows which _C was loaded.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_SO = os.environ["DEEPINFER_SANITIZED_CORE"]


class _SanitizedCore:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return importlib.util.spec_from_file_location(name, _SO) if name == "deepinfer_dp._C" else None


sys.meta_path.insert(0, _SanitizedCore)


def pytest_report_header(config) -> str:
    from deepinfer_dp import _C

    if os.path.realpath(_C.__file__) != os.path.realpath(_SO):
        raise RuntimeError(f"deepinfer_dp._C came from {_C.__file__}, not the sanitizer build {_SO}")
    return f"deepinfer_dp._C: {_C.__file__} (ASan + UBSan)"
