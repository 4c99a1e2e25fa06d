"""uvicorn around a server app: in the foreground (`serve`, the CLI) or on a thread of this
process (`ServerThread`: tests, the load bench).

Shutdown (Ctrl-C, SIGTERM, `ServerThread.stop()`): uvicorn stops listening and waits for the
requests in flight. When the app is `server.create_app`'s, its Service is told first (`drain`:
/health answers 503, new requests 503) and, once drain_timeout seconds have passed, ends what
is still open itself (`end_open`: streams get an error event and [DONE], non-streamed requests
a JSON 503), so the handlers finish on their own; uvicorn's own deadline, SHUTDOWN_GRACE
seconds later, which would cancel them mid-answer (cut streams, 500s, CancelledError
tracebacks), is not reached.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from typing import Callable, Optional

SHUTDOWN_GRACE = 10.0  # seconds past the drain time before uvicorn cancels the handlers


def _server(app, host: str, port: int, log_level: str, drain_timeout: Optional[float],
            stop_when: Optional[Callable[[], bool]] = None):
    """A uvicorn.Server whose shutdown tells the app's Service (see the module docstring) and
    that shuts down by itself once stop_when() is true (checked every tick, 0.1 s)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def on_tick(self, counter: int) -> bool:
            if stop_when is not None and stop_when():
                self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets=None):
            svc = getattr(getattr(app, "state", None), "ouroboros", None)  # create_app's
            timer = None
            if svc is not None:
                svc.drain()
                if drain_timeout is not None:
                    timer = asyncio.get_running_loop().call_later(drain_timeout, svc.end_open)
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

    grace = None if drain_timeout is None else drain_timeout + SHUTDOWN_GRACE
    return Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                 timeout_graceful_shutdown=grace, access_log=False))


def serve(app, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
          drain_timeout: Optional[float] = 30.0,
          stop_when: Optional[Callable[[], bool]] = None) -> None:
    """Runs the app in the foreground until Ctrl-C / SIGTERM (or until stop_when() is true:
    the engine broke), then returns. In-flight requests get up to drain_timeout seconds to
    finish; what is left is then cancelled (streams get an error event and [DONE], clients
    waiting on non-streamed requests a JSON 503)."""
    # uvicorn re-raises the signal it handled once its shutdown is done: SIGTERM's default
    # would kill the process there (before the caller's cleanup, exit status -15)
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, signal.default_int_handler) if main else None
    try:
        _server(app, host, port, log_level, drain_timeout, stop_when).run()
    except KeyboardInterrupt:  # SIGINT or SIGTERM, re-raised after the shutdown
        pass
    finally:
        if main:
            signal.signal(signal.SIGTERM, before)


class ServerThread:
    """uvicorn serving `app` on a thread of this process (tests, the load bench): the server
    shares this process's compiled functions. port=0 picks a free port; `url` says which.

        with ServerThread(create_app(engine)) as srv:
            openai.OpenAI(base_url=srv.url + "/v1", api_key="-")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *,
                 log_level: str = "warning", drain_timeout: Optional[float] = 30.0):
        self.app = app
        self.server = _server(app, host, port, log_level, drain_timeout)
        self.host = host
        self.port: Optional[int] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self._thread = threading.Thread(target=self.server.run, daemon=True,
                                        name="uvicorn")
        self._thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread died during startup (see its log)")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the server did not start within {timeout} s")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, cancel: bool = False, timeout: float = 60.0) -> None:
        """Stops serving. cancel=False: new connections are refused and requests in flight
        finish (up to drain_timeout); cancel=True: they are cancelled first."""
        if cancel:
            svc = self.app.state.ouroboros
            svc.stopping = True
            svc.engine.stop(cancel=True, timeout=timeout)
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the server thread did not stop within {timeout} s")

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
