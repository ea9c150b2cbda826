"""The Files and Batch APIs in OpenAI's shapes, and the seed's batch form.

``POST /v1/files`` (multipart: ``file``, ``purpose=batch``), ``GET /v1/files``,
``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``; ``POST /v1/batches``
(``input_file_id``, ``endpoint``, ``completion_window``, ``metadata``; or the
seed's ``model``, ``input_uri``, ``output_uri``, ``deadline``), ``GET
/v1/batches`` (``after``, ``limit``), ``GET /v1/batches/{id}``, ``POST
/v1/batches/{id}/cancel``. Errors are OpenAI's shape (``config.errors``).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.db.models import QuerySet
from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework.parsers import MultiPartParser
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.api.team_view import TeamView
from audit.api.base import AuditedMixin
from batches import services
from batches.api.schemas import (
    BATCH,
    BATCH_CREATE,
    FILE,
    FILE_UPLOAD,
    ID_PATTERN,
    list_parameters,
    page_of,
)
from batches.models import Batch
from config.api import ErrorSerializer
from config.errors import InvalidRequest, NotFound
from config.parsers import BodyParser

_ID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
_MAX_METADATA = 16


class _TeamView(TeamView):
    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        for name in ("file_id", "batch_id"):
            value = kwargs.get(name)
            if value is not None and not _ID.match(value):
                raise NotFound(f"no {name.removesuffix('_id')} {value!r}", param=name)


_AFTER_UNKNOWN = OpenApiResponse(
    ErrorSerializer, description="after names none of the team's files or batches."
)


def _path_id(name: str) -> OpenApiParameter:
    return OpenApiParameter(
        name, OpenApiTypes.STR, OpenApiParameter.PATH, pattern=ID_PATTERN
    )


class FileListView(_TeamView):
    parser_classes = [MultiPartParser]

    @extend_schema(
        operation_id="createFile",
        summary="Upload a batch's input (JSONL).",
        request=FILE_UPLOAD,
        responses={200: FILE},
    )
    def post(self, request: Request) -> Response:
        upload = request.FILES.get("file")
        if upload is None:
            raise InvalidRequest(
                "file is required (multipart form field 'file')", param="file"
            )
        data = request.data
        purpose = data.get("purpose") if hasattr(data, "get") else None
        if not isinstance(purpose, str):
            raise InvalidRequest("purpose is required", param="purpose")
        found = services.create_file(
            team_id=self.team(request),
            filename=upload.name or "batch.jsonl",
            purpose=purpose,
            chunks=upload.chunks(),
        )
        return Response(services.file_object(found), status=200)

    @extend_schema(
        operation_id="listFiles",
        summary="List the team's files.",
        parameters=[
            *list_parameters(most=10_000),
            OpenApiParameter("order", {"enum": ["asc", "desc"]}),
            OpenApiParameter("purpose", OpenApiTypes.STR),
        ],
        responses={200: page_of(FILE), 404: _AFTER_UNKNOWN},
    )
    def get(self, request: Request) -> Response:
        params = request.query_params
        order = params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
        page, has_more = services.list_files(
            team_id=self.team(request),
            after=_cursor(params.get("after")),
            limit=_limit(params.get("limit"), default=10_000, most=10_000),
            newest_first=order == "desc",
            purpose=params.get("purpose") or None,
        )
        return Response(_page([services.file_object(f) for f in page], has_more))


class FileDetailView(_TeamView):
    @extend_schema(
        operation_id="retrieveFile",
        summary="Describe a file.",
        parameters=[_path_id("file_id")],
        responses={200: FILE},
    )
    def get(self, request: Request, file_id: str) -> Response:
        found = services.get_file(team_id=self.team(request), file_id=file_id)
        return Response(services.file_object(found))


def _limit(text: str | None, *, default: int, most: int) -> int:
    if text is None:
        return default
    if not text.isdecimal() or not 1 <= int(text) <= most:
        raise InvalidRequest(
            f"limit must be an integer from 1 to {most}", param="limit"
        )
    return int(text)


def _cursor(text: str | None) -> str | None:
    if not text:
        return None
    if not _ID.match(text):
        raise InvalidRequest("after must be an id from a previous page", param="after")
    return text


def _page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:  # noqa: FBT001
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


class FileContentView(_TeamView):
    def perform_content_negotiation(
        self,
        request: Request,
        force: bool = False,  # noqa: FBT001, FBT002 (DRF's)
    ) -> tuple[Any, str]:
        # The content is the file's bytes whatever the client accepts (the SDK
        # asks for application/binary); only an error is rendered, as JSON.
        return JSONRenderer(), "application/json"

    @extend_schema(
        operation_id="downloadFile",
        summary="Read a file's bytes (a batch's input, output or errors).",
        parameters=[_path_id("file_id")],
        responses={
            (200, "application/jsonl"): {"type": "string"},
        },
    )
    def get(self, request: Request, file_id: str) -> StreamingHttpResponse:
        chunks = services.file_content(team_id=self.team(request), file_id=file_id)
        # An async iterator: under ASGI, Django would read a sync one whole first.
        return StreamingHttpResponse(_aiter(chunks), content_type="application/jsonl")


class BatchListView(_TeamView):
    parser_classes = [BodyParser]

    @extend_schema(
        operation_id="createBatch",
        summary="Start a batch of chat completions or embeddings.",
        request={"application/json": BATCH_CREATE},
        responses={
            200: BATCH,
            403: OpenApiResponse(
                ErrorSerializer, description="The team may not use the model."
            ),
            404: OpenApiResponse(
                ErrorSerializer, description="The team has no such input file."
            ),
        },
    )
    def post(self, request: Request) -> Response:
        body = request.data
        if not isinstance(body, dict):
            raise InvalidRequest("the body must be a JSON object")
        batch = services.create_batch(
            team_id=self.team(request),
            input_file_id=_string(body, "input_file_id"),
            input_uri=_string(body, "input_uri"),
            output_uri=_string(body, "output_uri"),
            model=_string(body, "model"),
            endpoint=_string(body, "endpoint") or "/v1/chat/completions",
            completion_window=_string(body, "completion_window"),
            deadline=_deadline(body.get("deadline")),
            metadata=_metadata(body.get("metadata")),
        )
        return Response(services.batch_object(batch), status=200)

    @extend_schema(
        operation_id="listBatches",
        summary="List the team's batches, newest first.",
        parameters=list_parameters(most=100),
        responses={200: page_of(BATCH), 404: _AFTER_UNKNOWN},
    )
    def get(self, request: Request) -> Response:
        params = request.query_params
        page, has_more = services.list_batches(
            team_id=self.team(request),
            after=_cursor(params.get("after")),
            limit=_limit(params.get("limit"), default=20, most=100),
        )
        return Response(_page([services.batch_object(b) for b in page], has_more))


class BatchDetailView(_TeamView):
    @extend_schema(
        operation_id="retrieveBatch",
        summary="Describe a batch.",
        parameters=[_path_id("batch_id")],
        responses={200: BATCH},
    )
    def get(self, request: Request, batch_id: str) -> Response:
        batch = services.get_batch(team_id=self.team(request), batch_id=batch_id)
        return Response(services.batch_object(batch))


class BatchCancelView(AuditedMixin, _TeamView):
    """A cancel is audited with the team's key that asked for it."""

    def audit_scope(self, request: Request, **kwargs: Any) -> list[QuerySet[Any]]:
        # Only what a cancel writes: the batch's runner moves its counts meanwhile.
        batch = Batch.objects.filter(pk=kwargs["batch_id"], team_id=self.team(request))
        return [batch.only(*services.CANCEL_FIELDS)]

    @extend_schema(
        operation_id="cancelBatch",
        summary="Cancel a batch: lines not started are not run.",
        parameters=[_path_id("batch_id")],
        request=None,
        responses={200: BATCH},
    )
    def post(self, request: Request, batch_id: str) -> Response:
        batch = services.cancel_batch(team_id=self.team(request), batch_id=batch_id)
        return Response(services.batch_object(batch))


async def _aiter(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """Read a blocking iterator off the event loop, a chunk at a time."""

    def read() -> bytes | None:
        return next(chunks, None)

    while (chunk := await sync_to_async(read, thread_sensitive=False)()) is not None:
        yield chunk


def _string(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise InvalidRequest(f"{name} must be a non-empty string", param=name)
    if len(value) > 1024:
        raise InvalidRequest(f"{name} is longer than 1,024 characters", param=name)
    return value.strip()


def _deadline(value: object) -> datetime | None:
    """A unix time in seconds, or an ISO 8601 time with its offset."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidRequest(
            "deadline must be a unix time or an ISO 8601 time", param="deadline"
        )
    if isinstance(value, int | float):
        try:
            return datetime.fromtimestamp(float(value), tz=UTC)
        except (OverflowError, OSError, ValueError):
            raise InvalidRequest("deadline is out of range", param="deadline") from None
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise InvalidRequest(
                "deadline must be a unix time or an ISO 8601 time", param="deadline"
            ) from None
        if moment.tzinfo is None:
            raise InvalidRequest(
                "deadline must carry its UTC offset (say '...Z')", param="deadline"
            )
        return moment
    raise InvalidRequest(
        "deadline must be a unix time or an ISO 8601 time", param="deadline"
    )


def _metadata(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("metadata must be an object of strings", param="metadata")
    if len(value) > _MAX_METADATA:
        raise InvalidRequest(
            f"metadata holds at most {_MAX_METADATA} pairs", param="metadata"
        )
    for key, item in value.items():
        bad = not isinstance(item, str) or "\x00" in key or "\x00" in item
        if bad or len(key) > 64 or len(item) > 512:
            raise InvalidRequest(
                "metadata keys are at most 64 characters and values strings of at "
                "most 512",
                param=f"metadata.{key}"[:100],
            )
    return dict(value)
