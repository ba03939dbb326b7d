"""A TCP link between loopback ports that a test breaks the way a network does.

    link = TcpLink(redis.port, "store")     # connections to 127.0.0.1:link.port reach redis
    link.cut()                              # a partition: no byte passes either way
    link.cut(up=False)                      # only target -> client blocked (answers lost)
    link.cut(down=False)                    # only client -> target blocked (requests lost)
    link.delay(2.0)                         # every chunk delivered 2 s late, in order
    link.restore()                          # healed: the connections open during the fault
                                            # are closed, new ones pass unharmed
    link.repoint(other.port)                # new connections go there, open ones are closed

"Up" is client -> target, "down" is target -> client. A cut direction passes no byte from
`cut()`'s return, and the connections stay open (nobody is told); what it holds is dropped, never
delivered late: `restore()` and `repoint()` close those connections before anything flows again,
and a chunk held longer than HOLD_MAX_S closes its connection. A delay applies to the chunks the
link receives after `delay()` (each at its arrival + the delay; never before an earlier one).
`last_down` is when bytes last went from the target to a client (time.monotonic()).

Everything listens on and connects to 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import collections
import select
import socket
import threading
import time

UP, DOWN = "up", "down"  # client -> target, target -> client
HOLD_MAX_S = 120.0  # a chunk a cut holds longer than this closes its connection
SEND_TIMEOUT_S = 10.0  # a peer that takes nothing for this long loses its connection
POLL_S = 0.05  # how often a waiting thread looks whether its connection is gone
QUEUED_CHUNKS_MAX = 4096  # a direction holding more stops reading (the sender's TCP backs off)


class _Pair:
    """A client's connection and the link's connection to the target for it, with what each
    direction has read and not yet delivered: (due time, bytes), or (due time, None) for the
    end of the stream. `ready[d]` (on the link's lock) wakes direction d's two threads."""

    def __init__(self, client: socket.socket, target: socket.socket, lock: threading.Lock):
        self.client, self.target = client, target
        self.queued = {UP: collections.deque(), DOWN: collections.deque()}
        self.ready = {UP: threading.Condition(lock), DOWN: threading.Condition(lock)}
        self.dead = False

    def close(self):
        self.dead = True
        for s in (self.client, self.target):
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes a reader in select/recv
            except OSError:
                pass
            s.close()


class TcpLink:
    """Connections to 127.0.0.1:`port` are piped to 127.0.0.1:`target` (see the module's
    docstring for what a test can do to them)."""

    def __init__(self, target: int, name: str = "link"):
        self.name = name
        self.target = target
        self.lock = threading.Lock()  # guards everything below and every pair's queues
        self.sent = threading.Condition(self.lock)  # a send ended: `cut()` waits for them
        self.blocked = {UP: False, DOWN: False}
        self.delay_s = {UP: 0.0, DOWN: 0.0}
        self.sending = {UP: 0, DOWN: 0}  # sends under way: `cut()` waits for them
        self.closed = False
        self.last_down = 0.0
        self.pairs: list[_Pair] = []
        self.threads: list[threading.Thread] = []
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self._spawn(self._accept_loop)

    # what a test does ------------------------------------------------------------------
    def cut(self, up: bool = True, down: bool = True):
        """From the return on, no byte passes in the named directions; connections stay open."""
        dirs = [d for d, on in ((UP, up), (DOWN, down)) if on]
        with self.lock:
            for d in dirs:
                self.blocked[d] = True
            deadline = time.monotonic() + SEND_TIMEOUT_S + 1
            while any(self.sending[d] for d in dirs) and time.monotonic() < deadline:
                self.sent.wait(POLL_S)
            assert not any(self.sending[d] for d in dirs), f"{self.name}: a send under way did not end"

    def delay(self, seconds: float, up: bool = True, down: bool = True):
        """Every chunk received from now on in the named directions is delivered `seconds`
        after it arrived (in order, so never before an earlier chunk)."""
        with self.lock:
            for d, on in ((UP, up), (DOWN, down)):
                if on:
                    self.delay_s[d] = seconds

    def restore(self):
        """Ends every cut and delay; the connections open now are closed first (what they
        hold is dropped), new ones pass unharmed."""
        self._close_pairs(heal=True)

    def repoint(self, target: int):
        """New connections go to `target`; the open ones are closed."""
        with self.lock:
            self.target = target
        self._close_pairs(heal=False)

    def close(self):
        with self.lock:
            self.closed = True
        self._close_pairs(heal=False)
        self.listener.close()
        for t in list(self.threads):
            t.join(timeout=2)

    # the pipes ---------------------------------------------------------------------------
    def _close_pairs(self, heal: bool):
        with self.lock:
            pairs, self.pairs = self.pairs, []
            for p in pairs:
                p.dead = True  # before anything flows again: what they hold is never sent
                for ready in p.ready.values():
                    ready.notify_all()
            if heal:
                self.blocked = {UP: False, DOWN: False}
                self.delay_s = {UP: 0.0, DOWN: 0.0}
        for p in pairs:
            p.close()

    def _spawn(self, fn, *args):
        t = threading.Thread(target=fn, args=args, daemon=True, name=f"tcp-link-{self.name}")
        t.start()
        self.threads.append(t)

    def _accept_loop(self):
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self.lock:
                target = self.target
            try:
                upstream = socket.create_connection(("127.0.0.1", target), timeout=2)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.settimeout(SEND_TIMEOUT_S)
                # Without it Nagle's algorithm here meets the peer's delayed ACK: every Redis
                # WAIT then waits ~40 ms more for the replica's REPLCONF ACK.
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client, upstream, self.lock)
            with self.lock:
                if self.closed or target != self.target:
                    pair.close()
                    continue
                self.pairs.append(pair)
            for direction, src, dst in ((UP, client, upstream), (DOWN, upstream, client)):
                self._spawn(self._read, pair, direction, src)
                self._spawn(self._deliver, pair, direction, dst)

    def _read(self, pair: _Pair, direction: str, src: socket.socket):
        """Queues what `src` sends, each chunk stamped with when it is due."""
        queued, ready = pair.queued[direction], pair.ready[direction]
        try:
            while not pair.dead:
                with self.lock:
                    full = len(queued) >= QUEUED_CHUNKS_MAX
                    if full:
                        ready.wait(POLL_S)
                if full:
                    continue
                readable, _, _ = select.select([src], [], [], POLL_S)
                if not readable:
                    continue
                data = src.recv(65536)
                with self.lock:
                    queued.append((time.monotonic() + self.delay_s[direction], data or None))
                    ready.notify_all()
                if not data:
                    return
        except (OSError, ValueError):  # ValueError: select on a socket closed meanwhile
            with self.lock:
                queued.append((time.monotonic(), None))
                ready.notify_all()

    def _deliver(self, pair: _Pair, direction: str, dst: socket.socket):
        """Sends the queued chunks to `dst` in order, each once due and while its direction
        is not cut; the end of the stream closes the pair."""
        queued, ready = pair.queued[direction], pair.ready[direction]
        try:
            while True:
                with self.lock:
                    if pair.dead or self.closed:
                        return
                    if not queued:
                        ready.wait(POLL_S)
                        continue
                    due, data = queued[0]
                    now = time.monotonic()
                    if now < due:
                        ready.wait(min(due - now, POLL_S))
                        continue
                    if self.blocked[direction]:
                        if now - due > HOLD_MAX_S:
                            return  # dropped with its connection
                        ready.wait(POLL_S)  # `restore()` closes the pair: no wake-up needed
                        continue
                    queued.popleft()
                    ready.notify_all()  # a reader waiting for room
                    if data is None:
                        return
                    self.sending[direction] += 1
                sent = False
                try:
                    dst.sendall(data)
                    sent = True
                finally:
                    with self.lock:
                        self.sending[direction] -= 1
                        if sent and direction == DOWN:
                            self.last_down = time.monotonic()
                        self.sent.notify_all()
        except OSError:
            pass
        finally:
            pair.close()
