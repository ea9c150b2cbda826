"""The OpenAI Files and Batch APIs under /v1/ (the rest of /v1 is the gateway's)."""

from django.urls import path

from batches.api import views

urlpatterns = [
    path("files", views.FileListView.as_view(), name="v1-files"),
    path("files/<str:file_id>", views.FileDetailView.as_view(), name="v1-file"),
    path(
        "files/<str:file_id>/content",
        views.FileContentView.as_view(),
        name="v1-file-content",
    ),
    path("batches", views.BatchListView.as_view(), name="v1-batches"),
    path("batches/<str:batch_id>", views.BatchDetailView.as_view(), name="v1-batch"),
    path(
        "batches/<str:batch_id>/cancel",
        views.BatchCancelView.as_view(),
        name="v1-batch-cancel",
    ),
]
