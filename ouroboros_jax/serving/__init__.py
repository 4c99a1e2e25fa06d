"""Serving: a continuous-batching engine over the decoding methods' seam (`engine`) and an
OpenAI-compatible server over it (`server`)."""

from ..request import FieldError, RequestParams, ValidRequest
from .engine import Engine
from .handle import Delta, QueueFull, RequestHandle, RequestResult

__all__ = ["Delta", "Engine", "FieldError", "QueueFull", "RequestHandle", "RequestParams",
           "RequestResult", "ValidRequest"]
