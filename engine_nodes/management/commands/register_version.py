"""Register a model version from a JSON file with the REST endpoint's body.

With ``--dir``, the version's identity comes from a local weights directory
instead: ``weights_uri`` (``file://`` + its path), ``weights_hash`` (the tree's
manifest digest, what the node agent verifies before serving), ``tokenizer_hash``
and ``chat_template`` are computed from its files, never typed. ``--file`` then
supplies the rest (``precision``, ``gpus_per_replica``, ``engine_config``...).

The command lives with the node's weights code (``engine_nodes.weights``) because
``--dir`` computes the digests the node agent verifies; the registry, below the
engine nodes, imports nothing of theirs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from rest_framework.exceptions import ValidationError

from config.api import validated
from config.errors import PlatformError, first_validation_error
from engine_nodes.weights import WeightsError, local_identity
from models_registry import services
from models_registry.api.serializers import VersionRegisterSerializer

_IDENTITY = ("weights_uri", "weights_hash", "tokenizer_hash", "chat_template")


class Command(BaseCommand):
    help = "Register a version: same body as POST /admin/models/{model}/versions."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model", help="The model name, e.g. chat-7b.")
        parser.add_argument("--file", type=Path, help="version.json")
        parser.add_argument(
            "--dir",
            type=Path,
            help="A local weights directory to compute the identity from "
            "(then --file is optional; precision defaults to fp16 on 1 GPU).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        path: Path | None = options["file"]
        directory: Path | None = options["dir"]
        if path is None and directory is None:
            raise CommandError("give --file, --dir or both")
        data: Any = {}
        if path is not None:
            try:
                data = json.loads(path.read_text())
            except OSError as exc:
                raise CommandError(f"cannot read {path}: {exc.strerror}") from None
            except json.JSONDecodeError as exc:
                raise CommandError(f"{path} is not valid JSON: {exc}") from None
        if directory is not None:
            if not isinstance(data, dict):
                raise CommandError(f"{path} must hold a JSON object")
            typed = sorted(set(_IDENTITY) & data.keys())
            if typed:
                raise CommandError(
                    f"{', '.join(typed)} come from --dir; leave them out of --file"
                )
            try:
                identity = local_identity(directory)
            except (WeightsError, OSError) as exc:
                raise CommandError(str(exc)) from None
            data = {"precision": "fp16", "gpus_per_replica": 1, **data, **identity}
        try:
            body = validated(VersionRegisterSerializer, data)
            version = services.register_version(model_id=options["model"], **body)
        except ValidationError as exc:
            param, message = first_validation_error(exc.detail)
            raise CommandError(f"{param}: {message}" if param else message) from None
        except PlatformError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(version.ref)
