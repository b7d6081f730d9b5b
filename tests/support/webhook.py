"""A real HTTP server on 127.0.0.1 that plays a webhook receiver by a script.

``Receiver(["503", "503", "200"])`` answers the first POSTs with those
statuses and 200 after the script runs out; ``"hang"`` holds the request
without answering until ``hang_s`` has passed (or the server stops), so the
sender's try times out. Every request is kept (status given, headers, body).
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson


class Receiver:
    def __init__(self, script=(), *, hang_s: float = 30.0) -> None:
        self.script = list(script)
        self.hang_s = hang_s
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the stdlib's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver._lock:
                    step = receiver.script.pop(0) if receiver.script else "200"
                    receiver.requests.append({"status": step, "headers": dict(self.headers),
                                              "body": body, "t": time.monotonic()})  # fmt: skip
                if step == "hang":
                    receiver._stop.wait(receiver.hang_s)
                    return  # no answer at all: the connection closes
                self.send_response(int(step))
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook/secret-token"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def accepted(self) -> list[dict]:
        """Bodies (decoded) of the requests answered 2xx."""
        with self._lock:
            return [orjson.loads(r["body"]) for r in self.requests if r["status"] == "200"]

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
