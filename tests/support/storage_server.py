"""A loopback HTTP file server with faults on demand, for the storage tests: answers 500 (the
next N requests, or all), drops the connection mid-answer, stalls, ignores Range, omits ETag and
Last-Modified, and serves files that the test replaces while it runs; and moto's standalone S3
server in its own process (:class:`MotoServer`)."""

from __future__ import annotations

import contextlib
import hashlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FaultyServer:
    """``files``: path -> bytes (replace entries while running). Faults: ``fail_next`` (that many
    requests get a 500), ``drop_next`` (that many are cut off after the headers), ``stall_s``
    (every request waits that long before answering), ``ignore_range``, ``versions`` (send ETag
    and Last-Modified), ``short_next`` (that many whole-object GETs get a well-formed body
    ``short_by`` bytes short: its Content-Length says so; a negative ``short_by``: longer).
    ``requests`` counts what the server saw."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.fail_next = 0
        self.fail_always = False
        self.drop_next = 0
        self.short_next = 0
        self.short_by = 300
        self.stall_s = 0.0
        self.ignore_range = False
        self.versions = True
        self.requests = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._answer(head=True)

            def do_GET(self) -> None:
                self._answer(head=False)

            def _answer(self, head: bool) -> None:
                with server._lock:
                    server.requests += 1
                    fail = server.fail_always or server.fail_next > 0
                    if server.fail_next > 0:
                        server.fail_next -= 1
                    drop = not fail and not head and server.drop_next > 0
                    if drop:
                        server.drop_next -= 1
                if server.stall_s:
                    time.sleep(server.stall_s)
                if fail:
                    body = b"internal error"
                    self.send_response(500)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if not head:
                        self.wfile.write(body)
                    return
                data = server.files.get(self.path)
                if data is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                rng = self.headers.get("Range")
                status, start, end = 200, 0, len(data)
                if rng and not server.ignore_range and rng.startswith("bytes="):
                    a, _, b = rng[6:].partition("-")
                    start = int(a) if a else 0
                    end = min(len(data), int(b) + 1) if b else len(data)
                    status = 206
                body = data[start:end]
                if status == 200 and not head and server.short_next > 0:
                    with server._lock:
                        server.short_next -= 1
                    body = (
                        body[: len(body) - server.short_by] if server.short_by > 0 else body + b"x" * -server.short_by
                    )
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                if server.versions:
                    self.send_header("ETag", '"' + hashlib.md5(data).hexdigest() + '"')
                    self.send_header("Last-Modified", "Wed, 02 Dec 2026 10:00:00 GMT")
                self.end_headers()
                if head:
                    return
                if drop:  # half the body, then the connection goes away
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> FaultyServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stall_s = 0.0
        self.httpd.shutdown()
        self.httpd.server_close()


class MotoServer:
    """moto's S3 server on a free port of 127.0.0.1, in its own process; ``log``: a file that
    gets its request log (one line per request: method, path, status)."""

    def __init__(self, log: str | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.p = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=open(log, "ab") if log else subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                assert self.p.poll() is None and time.monotonic() < deadline, "moto's server did not start"
                time.sleep(0.1)

    def gets(self, log: str, path: str) -> int:
        """How many GET requests for ``path`` (e.g. ``/bucket/key``) the log holds."""
        with open(log) as f:
            lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in f]  # the log is coloured
        return sum(f'"GET {path} ' in line or f'"GET {path}?' in line for line in lines)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGCONT)
            self.p.kill()
        self.p.wait(timeout=30)


@contextlib.contextmanager
def moto_bucket(monkeypatch: Any, bucket: str, log: str | None = None) -> Iterator[tuple[MotoServer, Any]]:
    """A fresh :class:`MotoServer` with an empty ``bucket``, the environment s3fs reads
    (credentials, endpoint) pointing at it for the test; yields the server and an s3fs file system."""
    import s3fs  # a test extra: the tests that call this skip without it

    server = MotoServer(log=log)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
    s3fs.S3FileSystem.clear_instance_cache()  # an instance keeps the endpoint it was made with
    fs = s3fs.S3FileSystem()
    fs.mkdir(bucket)
    try:
        yield server, fs
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()
