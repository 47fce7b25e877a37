"""Local storage servers for the tests: moto's S3 in server mode and an HTTP server with Range support.

The fixtures in tests/conftest.py start them; ``upload`` copies a local
shard folder to a URL.
"""

import contextlib
import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

KEY = SECRET = "testing"
REGION = "us-east-1"


def free_port():
    """Return a TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3 server in a subprocess on a free loopback port, with dummy credentials.

    Attributes:
        endpoint: ``http://127.0.0.1:PORT``.
        env: the AWS_* variables that point boto3 and s3fs at it.
        storage_options: s3fs keywords that do the same.
    """

    def __init__(self):
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.env = {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": REGION,
                    "AWS_ENDPOINT_URL": self.endpoint}
        self.storage_options = {"endpoint_url": self.endpoint, "key": KEY, "secret": SECRET}
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait()

    def _wait(self, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto.server exited with status {self.process.returncode}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
                return
            time.sleep(0.1)
        self.close()
        raise RuntimeError(f"moto.server did not answer on {self.endpoint} within {timeout} s")

    def client(self):
        """Return a boto3 S3 client of the server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                            region_name=REGION)

    def bucket(self, name=None):
        """Create a fresh bucket (a new name unless given); return ``s3://<name>``."""
        name = name or f"fd-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def close(self):
        """Stop the server."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def upload(local_folder, url, storage_options=None):
    """Copy every file under ``local_folder`` (hidden ones included) to the folder ``url``; return ``url``."""
    from fastdata.storage.urls import filesystem, join

    fs, _ = filesystem(url, storage_options)
    for parent, _, files in os.walk(local_folder):
        for name in files:
            relative = os.path.relpath(os.path.join(parent, name), local_folder).replace(os.sep, "/")
            fs.put_file(os.path.join(parent, name), fs._strip_protocol(join(url, relative)))
    fs.invalidate_cache()
    return url


# ---------------------------------------------------------------- plain HTTP with Range


_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root = None  # the folder served, set per server

    def log_message(self, format, *args):
        pass

    def do_HEAD(self):
        self._serve(body=False)

    def do_GET(self):
        self._serve(body=True)

    def _serve(self, body):
        path = os.path.join(self.root, urllib.request.url2pathname(self.path.split("?", 1)[0].lstrip("/")))
        if not os.path.isfile(path):
            self.send_error(404)
            return
        size = os.path.getsize(path)
        start, stop, status = 0, size, 200
        match = _RANGE.match(self.headers.get("Range", ""))
        if match and (match[1] or match[2]):
            if match[1]:
                start, stop = int(match[1]), min(size, int(match[2]) + 1) if match[2] else size
            else:
                start = max(0, size - int(match[2]))
            status = 206
        self.send_response(status)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(max(0, stop - start)))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        self.end_headers()
        if body:
            with open(path, "rb") as f:
                f.seek(start)
                self.wfile.write(f.read(max(0, stop - start)))


class HTTPServer:
    """A threaded HTTP server with Range support serving the folder ``root`` on a free loopback port."""

    def __init__(self, root):
        self.root = os.fspath(root)
        handler = type("Handler", (_RangeHandler,), {"root": self.root})
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def url_of(self, path):
        """Return the URL of ``path``, a file or folder under ``root`` (absolute, or relative to it)."""
        relative = os.path.relpath(os.path.join(self.root, os.fspath(path)), self.root)
        return self.url + "/" + urllib.request.pathname2url(relative).lstrip("/")

    def close(self):
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
