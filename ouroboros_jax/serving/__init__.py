"""Serving: a continuous-batching engine over the decoding methods' seam (`engine`)."""

from .engine import Delta, Engine, QueueFull, RequestHandle, RequestParams, RequestResult

__all__ = ["Delta", "Engine", "QueueFull", "RequestHandle", "RequestParams", "RequestResult"]
