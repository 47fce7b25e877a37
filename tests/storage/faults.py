"""A fault-injecting HTTP proxy for the tests: in front of moto on loopback, some requests fail by a seeded rule.

Built on fastdata.measure.throttle's proxy (headers and bodies pass through
as sent, so signed S3 requests stay valid); the faults are drawn here.
"""

import collections
import random
import re
import threading

from fastdata.measure.throttle import ThrottlingProxy, _ProxyHandler

FAULTS = ("503", "cut", "hang")
_ERROR = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
          "<Message>injected by FaultProxy</Message></Error>")


class FaultProxy(ThrottlingProxy):
    """Forward HTTP requests to ``upstream_url``; answer a share of them with a fault, drawn from ``seed``.

    Each request draws from one ``random.Random(seed)`` in the order requests
    arrive: with probability ``rate`` it gets one of ``faults``, chosen alike:
    "503" (S3's SlowDown, the request not forwarded), "cut" (forwarded, then
    the response's headers and half its body, and the connection closed; a
    response without a body is not sent at all) or "hang" (read, never
    answered until ``close``). Paths matching ``deny`` are answered 403
    AccessDenied every time.

    Attributes:
        served: a Counter of the faults answered, by kind ("503", "cut", "hang", "403").
    """

    def __init__(self, upstream_url, *, rate=0.0, faults=("503", "cut"), seed=0, deny=None, hang_seconds=120):
        super().__init__(upstream_url)
        unknown = set(faults) - set(FAULTS)
        if unknown or not 0 <= rate <= 1:
            raise ValueError(f"faults should be among {FAULTS} and 0 <= rate <= 1, got {faults!r}, rate={rate}")
        self.rate, self.faults, self.hang_seconds = float(rate), tuple(faults), float(hang_seconds)
        self.deny = re.compile(deny) if deny else None
        self.served = collections.Counter()
        self._random = random.Random(seed)
        self._released = threading.Event()

    def draw(self, path):
        """Count one request to ``path``; return its fault, or None to forward it as it is."""
        with self._lock:
            self.requests += 1
            if self.deny is not None and self.deny.search(path):
                kind = "403"
            elif self._random.random() < self.rate:
                kind = self._random.choice(self.faults)
            else:
                return None
            self.served[kind] += 1
            return kind

    def _count(self):  # the base class's fail_every: never; faults are drawn in draw()
        return False

    def close(self):
        """Release the hanging requests, stop serving and close the port."""
        self._released.set()
        super().close()


class _FaultHandler(_ProxyHandler):
    _cut = False

    def _inject(self):
        kind = self.proxy.draw(self.path)
        if kind in (None, "cut"):
            self._cut = kind == "cut"
            self._forward()
            return
        self._read_body()
        if kind == "hang":
            self.proxy._released.wait(self.proxy.hang_seconds)
            self.close_connection = True
            return
        status, code = (403, "AccessDenied") if kind == "403" else (503, "SlowDown")
        body = _ERROR.format(code=code).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _inject

    def _relay(self, response):
        if not self._cut:
            super()._relay(response)
            return
        body = response.read()
        self.close_connection = True
        if not body or self.command == "HEAD":
            return  # no body to cut: the answer is lost, as a connection reset after the request
        self.send_response_only(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in ("connection", "transfer-encoding", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2])
        self.wfile.flush()


FaultProxy.handler = _FaultHandler
