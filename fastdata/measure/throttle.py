"""A throttling HTTP reverse proxy: added latency, a bandwidth cap and failing requests, on loopback.

Put in front of a local S3 server (moto) it makes a link that looks like a
remote one, for the streaming benchmark and the fault tests.
"""

import http.client
import http.server
import threading
import time
import urllib.parse

_CHUNK = 64 << 10  # bytes of a response body sent (and paced) at a time
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "content-length"}
_ERROR_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
               b"<Message>Please reduce your request rate (ThrottlingProxy fail_every).</Message></Error>")


class _Bucket:
    """A token bucket shared by every connection: ``take(n)`` returns once ``n`` bytes fit the rate."""

    def __init__(self, rate):
        self.rate = float(rate)
        self.burst = self.rate / 50  # 20 ms of the rate may go at once
        self.chunk = int(min(_CHUNK, max(1024, self.burst)))  # bytes written at a time: a smooth pace
        self._lock = threading.Lock()
        self._tokens, self._time = self.burst, time.monotonic()

    def take(self, n):
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._time) * self.rate) - n
            self._time = now
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait:
            time.sleep(wait)


class ThrottlingProxy:
    """Forward HTTP requests to ``upstream_url``, slowed down and failing as asked.

    Headers (Host and Range included) and bodies pass through as the client
    sent them, so signed S3 requests stay valid.

    Args:
        upstream_url: e.g. ``http://127.0.0.1:5000``.
        latency: seconds added before each response.
        bandwidth: bytes per second for all response bodies together, or None.
        fail_every: answer every n-th request with ``fail_status`` (0: never).
        fail_status: the HTTP status of those answers (503: S3's SlowDown).

    Example:
        >>> with ThrottlingProxy("http://127.0.0.1:5000", latency=0.02) as proxy:
        ...     fs = s3fs.S3FileSystem(endpoint_url=proxy.url, key="testing", secret="testing")
    """

    def __init__(self, upstream_url, *, latency=0.0, bandwidth=None, fail_every=0, fail_status=503):
        parsed = urllib.parse.urlsplit(upstream_url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"upstream_url should be an http:// URL, got {upstream_url!r}")
        self.upstream = (parsed.hostname, parsed.port or 80)
        self.latency, self.fail_every, self.fail_status = float(latency), int(fail_every), int(fail_status)
        self.bucket = _Bucket(bandwidth) if bandwidth else None
        self.requests = 0  # requests received, failed ones included
        self.failed = 0  # requests answered with fail_status
        self._lock = threading.Lock()
        self._server = self._thread = None

    @property
    def url(self):
        """The proxy's ``http://127.0.0.1:PORT``; started on first use."""
        self.start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self):
        """Start serving on a free loopback port (once); return self."""
        if self._server is None:
            self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
            self._server.daemon_threads = True
            self._thread = threading.Thread(target=self._server.serve_forever, name="throttling-proxy", daemon=True)
            self._thread.start()
        return self

    def close(self):
        """Stop serving and close the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def _count(self):
        """Count one request; return whether it should fail."""
        with self._lock:
            self.requests += 1
            fail = self.fail_every > 0 and self.requests % self.fail_every == 0
            self.failed += fail
            return fail

    def __repr__(self):
        return (f"<ThrottlingProxy {self.upstream[0]}:{self.upstream[1]}: latency={self.latency}, "
                f"bandwidth={self.bucket and self.bucket.rate}, fail_every={self.fail_every}, "
                f"{self.requests} requests>")


def _handler_for(proxy):
    return type("Handler", (proxy.handler,), {"proxy": proxy})


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    proxy = None  # the ThrottlingProxy, set per server

    def log_message(self, format, *args):  # quiet: the tests run many requests
        pass

    def _forward(self):
        body = self._read_body()
        if self.proxy._count():
            self._fail()
            return
        if self.proxy.latency:
            time.sleep(self.proxy.latency)
        upstream = http.client.HTTPConnection(*self.proxy.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            self._relay(response)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away mid-response
        finally:
            upstream.close()

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

    def _read_body(self):
        """Return the request body, de-chunked (it goes upstream with a Content-Length)."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return b"".join(parts)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _fail(self):
        self.send_response(self.proxy.fail_status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(_ERROR_BODY)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(_ERROR_BODY)

    def _relay(self, response):
        """Send the upstream's response back, its body paced by the bandwidth cap."""
        body = response.read() if response.getheader("Content-Length") is None else None
        self.send_response_only(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in _HOP_BY_HOP:
                self.send_header(key, value)
        length = len(body) if body is not None else int(response.getheader("Content-Length"))
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if self.command == "HEAD" or response.status in (204, 304):
            return
        sent, step = 0, _CHUNK if self.proxy.bucket is None else self.proxy.bucket.chunk
        while sent < length:
            chunk = body[sent : sent + step] if body is not None else response.read(min(step, length - sent))
            if not chunk:
                break
            if self.proxy.bucket is not None:
                self.proxy.bucket.take(len(chunk))
            self.wfile.write(chunk)
            sent += len(chunk)


ThrottlingProxy.handler = _ProxyHandler  # the request handler a proxy serves with (a subclass may swap it)
