"""What the OpenAI server asks of an engine (`server.Service` reads it through this only)."""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

from ..request import RequestParams, ValidRequest
from .handle import RequestHandle


@runtime_checkable
class EngineAPI(Protocol):
    """What the server asks of an engine (`serving.engine.Engine` is one).

    model_name: the default name served. tokenizer: None when the model has none (no chat, no
    text). limit: prompt + max_tokens allowed. default_stop_ids: the model's own EOS ids.
    running: False once the engine can take no more work (/health answers 503).
    tokens(prompt) -> ids: a prompt (text, ids, chat messages) tokenized, chat rendered once;
    FieldError naming the prompt. validate(ids, params) -> ValidRequest: FieldError naming
    the field. submit(ValidRequest) -> RequestHandle: QueueFull when full, RuntimeError when
    stopped. metrics() -> dict (`serving/metrics.py` renders it). start(), stop(cancel,
    timeout): the engine's own thread."""

    model_name: str
    tokenizer: Any
    limit: int
    default_stop_ids: tuple
    running: bool

    def tokens(self, prompt) -> list: ...

    def validate(self, ids: list, params: RequestParams) -> ValidRequest: ...

    def submit(self, request: ValidRequest) -> RequestHandle: ...

    def metrics(self) -> dict: ...

    def start(self) -> None: ...

    def stop(self, cancel: bool = False, timeout: Optional[float] = None) -> None: ...
