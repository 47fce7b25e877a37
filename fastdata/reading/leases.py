"""Read leases on the files a process maps: a writer waits until no batch reads them, and the reader then refuses them.

NOTE [read leases]: a packed file truncated under a process that maps it
kills that process with SIGBUS at its next touch of a page past the new
end. Worker processes are watched from the parent (NOTE [worker bus error]
in workers.py), and the fingerprint compared before each batch (NOTE
[fingerprint] in datasets.py) narrows the window to one batch, but a file
truncated during the copy or the decode of a batch still killed the
reading process itself (the hostile run of issue 27: JPEG .h5 7 of 8
trials, Arrow 3 of 7, raw .h5 1 of 8, with num_workers=0; a JPEG batch
decodes from the map for milliseconds). Python cannot return from a
SIGBUS, and copying through syscalls instead of the map cost 3x at 32 px
(process_vm_readv: 238-250k against 507-739k rows/s). So each file a
process maps holds a Linux read lease (fcntl F_SETLEASE) on a descriptor
of its own: the kernel makes any process that opens the file for writing
or truncates it wait, and sends this process SIGIO first. The handler
(Python runs it in the main thread, so the lease's owner is the main
thread: F_SETOWN_EX) asks each descriptor whether its lease is breaking,
marks those files, and releases their leases at once if no batch is being
read, else the last batch to finish releases them. The writer thus waits
at most about one batch, and every read after that raises FormatError
naming the file instead of touching the map. Measured on 2 shared cores
beside a CI run (/tmp scripts, 1,200 64 px images): with the per-batch
check alone, 10 of 12 runs of read_batch over a file another process
truncated died of SIGBUS; with leases none did (tests/loading/
test_read_leases.py), and the writer waited 4-22 ms (16 runs, read_batch
and make_loader, raw and JPEG, HDF5 and Arrow). A lease costs one
descriptor per open shard and 15 us to take and release; a batch pays
``enter`` and ``leave``, 3.1 us, against about 300 us for a batch of 256
32 px images and 1 ms at 64 px.

Two things a writer sees: in the reading process itself, ``os.truncate``
of a leased file fails with InterruptedError (the lease-break signal
interrupts truncate(2), which Python does not retry; ``open`` is retried,
after the handler released the lease); and an open for writing with
O_NONBLOCK (coreutils ``truncate``) fails with EAGAIN, as the kernel
answers a non-blocking opener of a leased file. Either way the reader has
been told, and refuses the file from then on.

A lease is not taken (``unguarded`` says why) where the kernel refuses it
(not Linux; a filesystem without leases, such as NFS; a file owned by
another user, without CAP_LEASE; a file open for writing, EAGAIN), where
SIGIO has a handler that is not this module's, or where the first read in
a process comes from a thread other than the main one (only the main
thread may set a handler) before this process set the handler. Those reads
keep the fingerprint's window. A batch read for longer than the kernel's
``lease-break-time`` (45 s by default), or a main thread that runs no
Python for that long (the handler waits for it), lets the writer go on
under the maps.
"""

import fcntl
import os
import signal
import struct
import threading
import weakref

_F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)  # Linux's values, where the fcntl module lacks them
_F_GETLEASE = getattr(fcntl, "F_GETLEASE", 1025)
_F_SETOWN_EX = getattr(fcntl, "F_SETOWN_EX", 15)
_F_OWNER_TID = 0
_SIGNAL = signal.SIGIO  # the kernel's default lease-break signal

_registry = weakref.WeakSet()  # this process's Leases, looked through when a lease breaks


class Leases:
    """The read leases on one store's files in this process, taken as its shards open (see NOTE [read leases])."""

    def __init__(self, paths):
        self.paths = paths  # shard -> the path (or URL) errors name
        self.unguarded = _handler_missing()  # why no lease is taken in this process, or None
        self._held = {}  # shard -> the descriptor holding its lease
        self._broken = {}  # shard -> its path: a writer waits on it, or has gone on
        self._closed = set()  # shards closed while a batch read: released when it ends
        self._readers = 0  # batches between enter() and leave()
        self._lock = threading.Lock()
        self._pid = os.getpid()
        weakref.finalize(self, _release_all, self._held, self._pid)
        _registry.add(self)

    def take(self, shard, path):
        """Lease ``shard``'s local file ``path`` before it is checked and mapped; where no lease is possible, note why.

        A file that cannot be opened gets none: the check that follows reports it.
        """
        with self._lock:
            self._closed.discard(shard)
        if self.unguarded is not None or shard in self._held:
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
            fcntl.fcntl(fd, _F_SETOWN_EX, struct.pack("ii", _F_OWNER_TID, threading.main_thread().native_id))
        except OSError as exc:
            os.close(fd)
            self.unguarded = f"the kernel gave no read lease on {path!r} ({exc.strerror})"
            return
        self._held[shard] = fd

    def drop(self, shard):
        """Release ``shard``'s lease as its maps close; after the batches being read, if any (a broken one stays
        reported)."""
        with self._lock:
            if self._readers:
                self._closed.add(shard)
            else:
                _release(self._held, shard)

    def enter(self):
        """Begin reading the maps, unless a file was opened for writing or truncated meanwhile.

        Returns ``{shard: path}`` of those files, and then counts no read (the caller raises); else ``{}``.
        """
        with self._lock:
            if self._broken:
                if not self._readers:  # see NOTE [a break during leave]
                    for shard in list(self._broken):
                        _release(self._held, shard)
                return dict(self._broken)
            self._readers += 1
            return {}

    def leave(self):
        """End a read begun by ``enter``; the last one releases the leases that broke meanwhile."""
        # NOTE [a break during leave]: the SIGIO handler runs in the main
        # thread between bytecodes, also inside this block, where it marks a
        # breaking lease but cannot take the lock to release it. Marked after
        # the shards to release were listed, its lease stayed held: the next
        # read was refused (FormatError) at enter(), which released nothing,
        # and the writer waited for the kernel's lease-break-time (45.9 s in a
        # CI run of test_read_leases). So this loop lists the shards again
        # until none is left, and a refused enter() releases them too.
        with self._lock:
            self._readers -= 1
            while not self._readers and (pending := [shard for shard in (*self._broken, *self._closed)
                                                     if shard in self._held]):
                for shard in pending:
                    _release(self._held, shard)
            if not self._readers:
                self._closed.clear()

    def notice_breaks(self):
        """Mark the shards whose leases break; release them now if no batch is being read."""
        for shard, fd in list(self._held.items()):
            try:
                breaking = fcntl.fcntl(fd, _F_GETLEASE) != fcntl.F_RDLCK
            except OSError:  # released meanwhile
                continue
            if breaking:
                self._broken[shard] = self.paths[shard]
        if self._broken and self._lock.acquire(blocking=False):  # not blocking: the interrupted thread may hold it
            try:
                if not self._readers:
                    for shard in list(self._broken):
                        _release(self._held, shard)
            finally:
                self._lock.release()

    def __getstate__(self):
        raise TypeError("Leases belong to one process; a store makes new ones in another")


def install_handler():
    """Set this module's SIGIO handler from the main thread, unless SIGIO has another; return whether it is set."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(_SIGNAL) == signal.SIG_DFL:
        signal.signal(_SIGNAL, _on_lease_break)
    return signal.getsignal(_SIGNAL) is _on_lease_break


def _handler_missing():
    if not hasattr(fcntl, "F_RDLCK") or not hasattr(signal, "SIGIO"):
        return "this system has no file leases"
    if install_handler():
        return None
    if threading.current_thread() is not threading.main_thread():
        return "this process first read the dataset in a thread other than the main one, where no handler can be set"
    return f"SIGIO has another handler ({signal.getsignal(_SIGNAL)!r})"


def _on_lease_break(signum, frame):
    for leases in list(_registry):
        if leases._pid == os.getpid():
            leases.notice_breaks()


def _release(held, shard):
    fd = held.pop(shard, None)  # one atomic pop: a handler and a reader may both release
    if fd is not None:
        try:
            fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)  # a forked child's copy of fd keeps no lease alive
        except OSError:
            pass  # the kernel broke it already (lease-break-time)
        os.close(fd)


def _release_all(held, pid):
    if os.getpid() == pid:  # a forked child must not release its parent's leases
        for shard in list(held):
            _release(held, shard)
