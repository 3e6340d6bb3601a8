"""moto's S3-compatible server for test_obj_tier_e2e.py, in its own process.

``python _s3_server.py LOG`` binds 127.0.0.1 on an ephemeral port, prints
``PORT n``, and appends ``METHOD PATH`` to LOG for every request it answers.
It runs in its own process because importing Flask (moto's server) into the
test process breaks later in-process engines: vLLM's CPU platform walks every
loaded module's globals at engine start, and Flask's ``current_app`` proxy
raises "Working outside of application context" when touched.
"""

from __future__ import annotations

import select
import subprocess
import sys
import threading
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path


class S3Server:
    """The server process; ``requests()`` is its log so far."""

    def __init__(self, workdir: Path, start_timeout: float = 60) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self._log = workdir / "requests.log"
        self._log.touch()
        self._stderr = open(workdir / "server.stderr", "w")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, __file__, str(self._log)],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        try:
            ready, _, _ = select.select([self._proc.stdout], [], [], start_timeout)
            line = self._proc.stdout.readline() if ready else ""
            if not line.startswith("PORT "):
                raise RuntimeError(
                    f"moto's server did not start within {start_timeout}s: "
                    f"{line!r}, see {workdir / 'server.stderr'}"
                )
        except BaseException:
            self.stop()
            raise
        self.endpoint = f"127.0.0.1:{int(line.split()[1])}"

    def call(self, method: str, path: str) -> bytes:
        req = urllib.request.Request(f"http://{self.endpoint}{path}", method=method)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.read()

    def keys(self, bucket: str) -> list[str]:
        root = ET.fromstring(self.call("GET", f"/{bucket}?list-type=2"))
        return sorted(e.text or "" for e in root.iter() if e.tag.endswith("}Key"))

    def requests(self) -> list[tuple[str, str]]:
        lines = self._log.read_text().splitlines()
        return [tuple(ln.split(" ", 1)) for ln in lines]  # type: ignore[misc]

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._stderr.close()


def main() -> None:
    from moto.moto_server.threaded_moto_server import MotoRequestHandler
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    log = open(sys.argv[1], "a", buffering=1)  # noqa: SIM115 (line-buffered)
    lock = threading.Lock()  # the server answers each request in a thread

    def logged(environ, start_response):
        with lock:
            log.write(f"{environ['REQUEST_METHOD']} {environ['PATH_INFO']}\n")
        return app(environ, start_response)

    server = make_server(
        "127.0.0.1", 0, logged, threaded=True, request_handler=MotoRequestHandler
    )
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()  # until SIGTERM


if __name__ == "__main__":
    main()
