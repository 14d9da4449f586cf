"""The repository's kernels/ folder must not shadow Hugging Face's `kernels` package.

transformers >= 5.25 depends on `kernels` and imports it with every model config. A `python` or
`python -m` started in the repository root puts the root first on sys.path, where a regular
package in kernels/ (one with an __init__.py) would be found first and the import fail
(`cannot import name 'CUDAProperties' from 'kernels'`): the README's `python -m kvscale.worker.bench`
and every test that runs a child process from the root failed so. kvscale.kernels is therefore a
namespace package, which the import system passes over when a regular `kernels` exists.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_folder_is_a_namespace_package():
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_transformers_imports_a_model_config_from_the_repository_root():
    code = (
        "import importlib.util\n"
        "from transformers import LlamaConfig\n"  # imports `kernels` when transformers depends on it
        "from kvscale.kernels.dispatch import rms_norm\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(spec.origin if spec else None)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    origin = done.stdout.strip().splitlines()[-1]
    # Either Hugging Face's package (a file in site-packages) or no file at all (our namespace folder
    # when that package is absent): never a regular package in the repository.
    assert not origin.startswith(str(ROOT / "kernels")), origin
