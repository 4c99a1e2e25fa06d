"""uvicorn around a server app: in the foreground (`serve`, the CLI) or on a thread of this
process (`ServerThread`: tests, the load bench)."""

from __future__ import annotations

import threading
import time
from typing import Optional


def _config(app, host: str, port: int, log_level: str, drain_timeout: Optional[float]):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          timeout_graceful_shutdown=drain_timeout, access_log=False)


def serve(app, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
          drain_timeout: Optional[float] = 30.0) -> None:
    """Runs the app in the foreground until Ctrl-C / SIGTERM. In-flight requests get up to
    drain_timeout seconds to finish; what is left is then cancelled (streams get an error
    event, clients waiting on non-streamed requests a 503)."""
    import uvicorn

    try:
        uvicorn.Server(_config(app, host, port, log_level, drain_timeout)).run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after its shutdown
        pass


class ServerThread:
    """uvicorn serving `app` on a thread of this process (tests, the load bench): the server
    shares this process's compiled functions. port=0 picks a free port; `url` says which.

        with ServerThread(create_app(engine)) as srv:
            openai.OpenAI(base_url=srv.url + "/v1", api_key="-")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *,
                 log_level: str = "warning", drain_timeout: Optional[float] = 30.0):
        import uvicorn

        self.app = app
        self.server = uvicorn.Server(_config(app, host, port, log_level, drain_timeout))
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
