"""Processes that decode a share of each JPEG batch beside the calling thread, into memory they share with it.

NOTE [decode lanes]: threads decoding small JPEGs in one process take the
GIL once per image, and on this 2-core VM the handoffs left cores idle: 64
px JPEGs (the records section's pairs) decoded by 2 threads sharing a
row counter cost 31-33 us of CPU an image against 26-28 on one thread, and
kept 1.1-1.7 of the 2 cores busy (/tmp/p30/dec3.py). A lane is a process of
its own (one GIL each): the caller copies the lane's share of the batch's
JPEG bytes into a shared memory file (memfd), the lane decodes them into
rows after them, and the caller, having decoded its own share meanwhile,
copies those rows into the batch. A prototype with one lane, each side
taking half of every batch of 256, decoded 57,000-63,000 img/s at 1.8
cores busy, 0.81-1.16 (median 0.94) of the decode limit in turn, where
the loader's threads reached about 0.74 (/tmp/p30/partner.py). A lane is
started on first use (a fresh interpreter: about 0.2 s, during which the
batches are decoded on threads) and ends when its socket closes: when the
caller drops it, exits or is killed.
"""

import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref

import numpy as np

from fastdata.codecs.images import jpeg_decoder_into

ALIGN = 64  # the rows start on a cache line
END_SECONDS = 5.0  # how long a lane asked to end may take before it is killed
_REQUEST = struct.Struct("7q")  # bytes mapped, rows, grey, height, width, channels, where the rows start
_READY, _DONE = b"ready", b"done"
_MINE = weakref.WeakSet()  # this process's lanes: a forked child lets go of its copies (see _forget_inherited)
_LOCK = threading.Lock()
_idle = {"pid": None, "lanes": [], "made": 0, "failed": None}  # this process's lanes not in use, and how many it has


def take(count):
    """Return up to ``count`` of this process's lanes that are ready and idle, for one caller until ``give_back``.

    Starts lanes until this process has ``count`` (they are ready about 0.2 s later): a caller given fewer
    decodes the rest itself.
    """
    with _LOCK:
        if _idle["pid"] != os.getpid():  # a forked child starts its own
            _idle.update(pid=os.getpid(), lanes=[], made=0, failed=None)
        if _idle["failed"] is not None:
            raise LaneError(_idle["failed"])
        while _idle["made"] < count:
            _idle["lanes"].append(DecodeLane())
            _idle["made"] += 1
        ready = [lane for lane in _idle["lanes"] if lane.is_ready()][:count]
        unborn = [lane for lane in _idle["lanes"] if not lane.alive]
        if unborn:  # it could not start: a fault of this installation, not of one batch
            _idle["failed"] = (f"a JPEG decode lane (process {unborn[0].pid}, {sys.executable} -m {__name__}) ended "
                               f"as it started, with status {unborn[0].returncode()}; its output says why")
            raise LaneError(_idle["failed"])
        _idle["lanes"] = [lane for lane in _idle["lanes"] if lane not in ready]
        return ready


def give_back(lanes):
    """Return ``lanes`` (from ``take``) to the idle ones; a lane that ended is replaced at the next ``take``."""
    with _LOCK:
        if _idle["pid"] != os.getpid():
            return
        alive = [lane for lane in lanes if lane.alive]
        _idle["lanes"] += alive
        _idle["made"] -= len(lanes) - len(alive)


class LaneError(RuntimeError):
    """A lane could not decode its share: ``row`` (of the share) did not decode, or the lane ended (row None)."""

    def __init__(self, message, row=None):
        super().__init__(message)
        self.row = row


class DecodeLane:
    """One process decoding the JPEGs it is given, a share of a batch at a time (see NOTE [decode lanes])."""

    def __init__(self):
        self._owner = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._memfd = os.memfd_create("fastdata-decode-lane")
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), str(self._memfd)],
                pass_fds=(theirs.fileno(), self._memfd), stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            os.close(self._memfd)
            raise
        finally:
            theirs.close()
        self._socket, self._memory, self.ready, self.alive = ours, None, False, True
        self.requests, self.seconds = 0, 0.0  # shares asked for; the time the last one took to decode
        self._end = weakref.finalize(self, _end, self._owner, self._process, ours, self._memfd)
        _MINE.add(self)

    @property
    def pid(self):
        return self._process.pid

    def returncode(self):
        """Return the lane's exit status, waiting briefly for it (None while it runs on)."""
        try:
            return self._process.wait(0.5)
        except subprocess.TimeoutExpired:
            return None

    def is_ready(self):
        """Return whether the lane has started and waits for work (never blocks)."""
        if not self.ready:
            self._socket.setblocking(False)
            try:
                self.ready = self._socket.recv(len(_READY)) == _READY
                self.alive = self.ready  # else it ended before it began
            except BlockingIOError:
                pass
            finally:
                self._socket.setblocking(True)
        return self.ready

    def start(self, sources, starts, stops, shape, grey):
        """Have the lane decode the JPEGs ``sources[k][starts[k]:stops[k]]`` into rows of ``shape`` (H, W, C)."""
        count = len(starts)
        table = 16 * count
        lengths = np.asarray(stops, np.int64) - np.asarray(starts, np.int64)
        at = table + np.concatenate([[0], np.cumsum(lengths)])
        rows_at = -(-int(at[-1]) // ALIGN) * ALIGN
        size = rows_at + count * int(np.prod(shape))
        memory = self._room(size)
        bounds = np.frombuffer(memory, np.int64, 2 * count).reshape(count, 2)
        bounds[:, 0], bounds[:, 1] = at[:-1], at[1:]
        view = memoryview(memory)
        for source, start, stop, place in zip(sources, starts, stops, at[:-1].tolist()):
            view[place : place + stop - start] = source[start:stop]
        del view, bounds
        try:
            self._socket.send(_REQUEST.pack(len(memory), count, int(grey), *shape, rows_at))
        except OSError as exc:
            self.close()
            raise LaneError(f"the decode lane (process {self.pid}) ended ({exc})") from exc
        self._rows = (rows_at, count, shape)
        self.requests += 1

    def finish(self):
        """Wait for the share ``start`` gave; return its rows, uint8 ``[N, H, W, C]`` (valid until the next start).

        ``seconds`` is then the time the lane took to decode them.

        Raises LaneError where a row did not decode (its ``row``) or the lane ended.
        """
        try:
            reply = self._socket.recv(4096)
        except OSError as exc:
            reply = f"E {exc}".encode()
        if not reply.startswith(_DONE):
            row, _, why = reply.decode(errors="replace").partition(" ")
            if not reply or row == "E":
                self.close()
                raise LaneError(f"the decode lane (process {self.pid}) ended ({why or 'no reply'})")
            raise LaneError(why, int(row))
        rows_at, count, shape = self._rows
        self.seconds = float(reply[len(_DONE):])
        return np.frombuffer(self._memory, np.uint8, count * int(np.prod(shape)), rows_at).reshape(count, *shape)

    def _room(self, size):
        """Return the shared memory, grown to hold at least ``size`` bytes."""
        if self._memory is None or len(self._memory) < size:
            size = max(size, 2 * len(self._memory) if self._memory is not None else 0, mmap.PAGESIZE)
            os.ftruncate(self._memfd, size)
            self._memory = mmap.mmap(self._memfd, size)  # the old map goes with its last view
        return self._memory

    def close(self):
        """End the lane (its reply to a share under way is dropped)."""
        self.alive = False
        self._end()


def _end(owner, process, ours, memfd):
    if os.getpid() != owner:  # an inherited copy: the owner ends the lane
        return
    ours.close()
    os.close(memfd)
    try:
        process.wait(END_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(END_SECONDS)


def _forget_inherited():
    """In a forked child: close the lanes' socket copies, so that a lane sees its owner end."""
    for lane in list(_MINE):
        lane._socket.close()


os.register_at_fork(after_in_child=_forget_inherited)


def serve(sock, memfd):
    """The lane's loop: decode each request's JPEGs into the rows after them, reply, until the socket closes."""
    memory = None
    try:
        sock.send(_READY)
        while message := sock.recv(_REQUEST.size):
            size, count, grey, height, width, channels, rows_at = _REQUEST.unpack(message)
            if memory is None or len(memory) < size:
                memory = mmap.mmap(memfd, os.fstat(memfd).st_size)
            began = time.perf_counter()
            failed = _decoded(memory, count, bool(grey), (height, width, channels), rows_at)
            sock.send(failed or b"%s%.6f" % (_DONE, time.perf_counter() - began))
    except ConnectionError:  # the owner ended: so does the lane
        pass


def _decoded(memory, count, grey, shape, rows_at):
    """Decode one request's rows; return None, or the reply naming the row that failed and why."""
    bounds = np.frombuffer(memory, np.int64, 2 * count).reshape(count, 2).tolist()
    rows = np.frombuffer(memory, np.uint8, count * int(np.prod(shape)), rows_at).reshape(count, *shape)
    data, decode = memoryview(memory), jpeg_decoder_into(grey)
    try:
        for row, (start, stop) in enumerate(bounds):
            try:
                decode(data[start:stop], buffer=rows[row])
            except Exception as exc:
                return f"{row} {type(exc).__name__}: {exc}".encode()[:4000]
        return None
    finally:
        del data, rows


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the owner decides
    serve(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]))
