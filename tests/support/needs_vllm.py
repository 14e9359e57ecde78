"""Import this first in a vLLM test module: without vLLM installed (the ``vllm`` extra) the
module is skipped, except under ``CI=true``, where the vLLM tests must run and it fails.

    import tests.support.needs_vllm  # noqa: F401  (before anything that imports vLLM)
    # isort: split
"""

from __future__ import annotations

import inspect
import os
import sys

import pytest

try:
    import vllm  # noqa: F401
except ImportError as _exc:  # pragma: no cover - depends on the environment
    _importer = next((f.filename for f in inspect.stack()[1:]
                      if os.path.basename(f.filename).startswith("test_")), "a vLLM test module")
    _why = f"vLLM is not installed ({_exc}); install the `vllm` extra to run the vLLM tests"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{_why} (CI=true: the vLLM tests must run in CI)", pytrace=False)
    print(f"SKIP {os.path.relpath(_importer)}: {_why}", file=sys.stderr)
    pytest.skip(_why, allow_module_level=True)
