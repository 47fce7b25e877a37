"""A local S3 server (moto) with throttling proxies in front of it, for the streaming section.

moto's server runs as ``python -m moto.server`` on a free loopback port
with dummy credentials; each ThrottlingProxy (fastdata/measure/throttle.py)
runs in a process of its own, so that its threads never take the GIL from
the loader being measured.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager, suppress

KEY = SECRET = "testing"
REGION = "us-east-1"

PROXY_SCRIPT = """\
import json, sys
from fastdata.measure.throttle import ThrottlingProxy

args = json.loads(sys.argv[1])
with ThrottlingProxy(args["upstream"], latency=args["latency"], bandwidth=args["bandwidth"]) as proxy:
    print(proxy.url, flush=True)
    sys.stdin.read()  # serve until the section closes this process's stdin
    print(json.dumps({"requests": proxy.requests}), flush=True)
"""


def s3_options(endpoint):
    """Return the storage_options (s3fs's) that reach the server or proxy at ``endpoint``."""
    return {"endpoint_url": endpoint, "key": KEY, "secret": SECRET}


def boto_options(endpoint):
    """Return the boto3 client options (LitData's storage_options) that reach ``endpoint``."""
    return {"endpoint_url": endpoint, "aws_access_key_id": KEY, "aws_secret_access_key": SECRET,
            "region_name": REGION}


@contextmanager
def servers(latencies, bandwidth):
    """Start moto's S3 server and a ThrottlingProxy process per latency; yield ``(endpoint, {latency: url}, requests)``.

    ``requests`` (latency -> requests its proxy served) is filled in when they stop.
    """
    started, requests = [], {}
    try:
        port = _free_port()
        moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(moto)
        endpoint = f"http://127.0.0.1:{port}"
        _wait_for(endpoint + "/moto-api/", moto)
        proxies = {}
        for latency in latencies:
            args = json.dumps({"upstream": endpoint, "latency": latency, "bandwidth": bandwidth})
            proxy = subprocess.Popen([sys.executable, "-c", PROXY_SCRIPT, args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
            started.append(proxy)
            proxies[latency] = proxy.stdout.readline().strip()
            if not proxies[latency].startswith("http://"):
                raise RuntimeError(f"the ThrottlingProxy process exited ({proxy.wait()}) before serving")
        yield endpoint, proxies, requests
    finally:
        for latency, process in zip(latencies, started[1:]):
            with suppress(OSError, ValueError, subprocess.TimeoutExpired):  # a proxy ends at its stdin's end...
                requests[latency] = json.loads(process.communicate("", timeout=10)[0])["requests"]  # ...counting
        for process in reversed(started):
            _stop(process)


def upload(root, names, url, storage_options):
    """Copy the files ``names`` of the folder ``root``, in that order, to the folder ``url``; return ``url``."""
    from fastdata.storage.urls import filesystem

    fs, path = filesystem(url, storage_options)
    bucket = path.split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for name in names:
        fs.put_file(os.path.join(root, name), f"{path}/{name}")
    return url


def _stop(process):
    process.terminate()
    with suppress(subprocess.TimeoutExpired):
        process.wait(10)
    if process.poll() is None:
        process.kill()
        process.wait()
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            pipe.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url, process, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto.server exited with status {process.returncode}; pip install 'moto[server]'")
        with suppress(OSError):
            urllib.request.urlopen(url, timeout=1).close()
            return
        time.sleep(0.1)
    raise RuntimeError(f"moto.server did not answer on {url} within {timeout} s")
