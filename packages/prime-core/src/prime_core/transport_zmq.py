"""ZMQ rollout transport: the orchestrator sends each trainer rank its micro-batches over TCP.

Trainer rank ``r`` binds a ROUTER on ``tcp://bind_host:base_port + r``; the orchestrator connects a DEALER to
``base_port + r`` on the host of rank r's node. A message is ``[b"DATA", step, mac, payload]`` where the payload is
the same safetensors bytes as the filesystem transport's file and ``mac`` an HMAC of rank, step and payload under the
run's secret (``prime_core.transport.transport_secret``): a message of another run, of an earlier launch's
orchestrator, of a foreign process or meant for another rank is dropped and logged, never trained on. The receiver
answers ``[b"ACK", step, mac]`` once ``receive(step)`` hands the batch to the trainer. The sender re-sends what a
rank has not acknowledged when its connection comes back (ZMQ reconnects the DEALER by itself; a trainer that
restarts mid-run still gets what it had not consumed), and otherwise only every ``resend_interval`` (60 s): the
trainer reads nothing while it trains, so every copy sent meanwhile is held in its memory until the next step.
Duplicates are acknowledged and dropped. ``import zmq`` happens
here only.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import threading
import time
from typing import Any

import numpy as np

from prime_core.config.base import ConfigError
from prime_core.io import UnreadableFile, first_line
from prime_core.schemas.microbatch import (
    MicroBatch,
    RolloutBatchMeta,
    decode_microbatches,
    microbatch_file_metadata,
    microbatch_tensors,
)

logger = logging.getLogger("prime.transport")
MAX_STEP_DIGITS = 12


def _zmq():
    try:
        import zmq
    except ImportError as e:
        raise ImportError("the zmq rollout transport needs pyzmq: pip install 'prime-core[zmq]'") from e
    return zmq


def encode(meta: RolloutBatchMeta, micro_batches: list[MicroBatch]) -> bytes:
    """The micro-batch file's bytes (same layout as ``write_microbatches``)."""
    from safetensors.numpy import save

    tensors: dict[str, np.ndarray] = {}
    for i, mb in enumerate(micro_batches):
        tensors.update(microbatch_tensors(i, mb))
    return save(tensors, metadata=microbatch_file_metadata(meta, tensors))


def decode(payload: bytes) -> tuple[RolloutBatchMeta, list[MicroBatch]]:
    return decode_microbatches(payload)


def mac(secret: bytes, kind: bytes, rank: int, raw_step: bytes, payload: bytes | memoryview = b"") -> bytes:
    """What signs a message: its kind, the rank it is for, its step and its payload (a resent batch is not re-hashed:
    the sender keeps the mac with the payload)."""
    h = hmac.new(secret, b"%s %d %s " % (kind, rank, raw_step), hashlib.sha256)
    h.update(payload)
    return h.digest()


def parse_step(raw: bytes) -> int | None:
    """A step frame's number, or None for anything but a plain non-negative decimal."""
    return int(raw) if raw.isdigit() and len(raw) <= MAX_STEP_DIGITS else None


class ZmqSender:
    """Orchestrator side. ``send`` queues; a background thread owns the sockets, resends and reads acks."""

    def __init__(
        self,
        config: Any,
        num_ranks: int,
        secret: bytes,
        *,
        resend_interval: float = 60.0,
        drain_timeout: float = 600.0,
    ):
        zmq = _zmq()
        hosts = config.hosts
        if num_ranks % len(hosts):
            raise ConfigError(
                f"transport.host names {len(hosts)} trainer node(s) for {num_ranks} trainer ranks: the ranks must "
                "split evenly over the nodes"
            )
        per_host = num_ranks // len(hosts)
        self.num_ranks = num_ranks
        self.secret = secret
        self.max_bytes = config.max_message_mb << 20
        self.resend_interval = resend_interval
        self.drain_timeout = drain_timeout
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._outbox: list[tuple[int, int, list[bytes]]] = []  # (rank, step, frames) not yet handed to the thread
        self._unacked: dict[tuple[int, int], tuple[list[bytes], float]] = {}
        self._stop = threading.Event()
        self._endpoints = [f"tcp://{hosts[r // per_host]}:{config.base_port + r}" for r in range(num_ranks)]
        self._thread = threading.Thread(target=self._loop, name="zmq-sender", daemon=True)
        self._thread.start()

    def send(self, step: int, rank: int, meta: RolloutBatchMeta, micro_batches: list[MicroBatch]) -> None:
        payload = encode(meta, micro_batches)
        if len(payload) > self.max_bytes:
            raise ValueError(
                f"step {step}: the batch for trainer rank {rank} is {len(payload) >> 20} MiB, over "
                f"transport.max_message_mb ({self.max_bytes >> 20}); raise it on both sides or pack smaller batches"
            )
        raw_step = str(step).encode()
        frames = [b"DATA", raw_step, mac(self.secret, b"DATA", rank, raw_step, payload), payload]
        with self._lock:
            self._outbox.append((rank, step, frames))

    def num_unacked(self) -> int:
        with self._lock:
            return len(self._unacked) + len(self._outbox)

    def _loop(self) -> None:
        zmq = _zmq()
        from zmq.utils.monitor import recv_monitor_message

        socks, monitors = [], []
        poller = zmq.Poller()
        for ep in self._endpoints:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RECONNECT_IVL, 100)
            s.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # acks only
            monitor = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            s.connect(ep)
            poller.register(s, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            socks.append(s)
            monitors.append(monitor)
        lost_at: list[float | None] = [None] * len(socks)  # when rank r's connection last dropped
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                with self._lock:
                    fresh, self._outbox = self._outbox, []
                    for rank, step, frames in fresh:
                        self._unacked[(rank, step)] = (frames, -float("inf"))
                    due = [(k, f) for k, (f, t) in self._unacked.items() if now - t >= self.resend_interval]
                    for k, f in due:
                        self._unacked[k] = (f, now)
                for (rank, _), frames in due:
                    with contextlib.suppress(zmq.Again):
                        socks[rank].send_multipart(frames, flags=zmq.NOBLOCK)
                for sock, _ in poller.poll(50):
                    if sock in monitors:
                        rank = monitors.index(sock)
                        event = recv_monitor_message(sock)["event"]
                        if event == zmq.EVENT_DISCONNECTED:
                            lost_at[rank] = time.monotonic()
                        elif lost_at[rank] is not None:
                            self._resend_after_reconnect(rank, lost_at[rank])
                            lost_at[rank] = None
                    else:
                        self._read_acks(zmq, sock, socks.index(sock))
        finally:
            for s, monitor in zip(socks, monitors, strict=True):
                s.disable_monitor()
                monitor.close(0)
                s.close(0)

    def _resend_after_reconnect(self, rank: int, lost_at: float) -> None:
        """What went out to rank r before its connection dropped may be lost with it (a trainer that restarted):
        due again now. What was queued since waits in the socket and goes out on the new connection by itself."""
        with self._lock:
            for (r, step), (frames, sent) in self._unacked.items():
                if r == rank and sent <= lost_at:
                    self._unacked[(r, step)] = (frames, -float("inf"))

    def _read_acks(self, zmq: Any, sock: Any, rank: int) -> None:
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            # Only the trainer rank that holds the secret can acknowledge: something else on the port (a stale
            # trainer that kept it) cannot make this side drop batches the trainer never got.
            if len(frames) != 3 or frames[0] != b"ACK" or (step := parse_step(frames[1])) is None:
                continue
            if hmac.compare_digest(frames[2], mac(self.secret, b"ACK", rank, frames[1])):
                with self._lock:
                    self._unacked.pop((rank, step), None)

    def pending(self) -> str:
        """The unacknowledged steps by rank and endpoint, for the message of a drain that gave up."""
        by_rank: dict[int, list[int]] = {}
        with self._lock:
            keys = [*self._unacked, *((r, s) for r, s, _ in self._outbox)]
        for rank, step in sorted(keys):
            by_rank.setdefault(rank, []).append(step)
        return "; ".join(f"rank {r} ({self._endpoints[r]}): steps {steps}" for r, steps in by_rank.items())

    def close(self) -> None:
        """Wait (up to drain_timeout) until every rank acknowledged every step, then stop."""
        deadline = time.monotonic() + self.drain_timeout
        while self.num_unacked() and time.monotonic() < deadline:
            time.sleep(0.05)
        left, pending = self.num_unacked(), self.pending()
        self._stop.set()
        self._thread.join()
        self._ctx.term()
        if left:
            logger.warning(
                "zmq sender: after %.0fs no trainer acknowledgement of %d batch(es) (%s); was the trainer running, "
                "with this run's transport secret?",
                self.drain_timeout,
                left,
                pending,
            )


class ZmqReceiver:
    """Trainer side (rank ``rank``): binds ``base_port + rank`` and returns the batch of a requested step."""

    def __init__(self, config: Any, rank: int, secret: bytes, on_wait=None, *, log_every: float = 30.0):
        zmq = _zmq()
        self.rank = rank
        self.secret = secret
        self.on_wait = on_wait
        self.log_every = log_every
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 64)  # per peer: a flood waits in its own socket, not in this process
        # Bounds what a peer can make this rank hold before its secret is checked: a bigger frame drops the peer.
        self._sock.setsockopt(zmq.MAXMSGSIZE, (config.max_message_mb << 20) + (1 << 16))
        port = config.base_port + rank
        self.endpoint = f"tcp://{config.bind_host}:{port}"
        try:
            self._sock.bind(self.endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise ConfigError(
                f"trainer rank {rank}: cannot bind {self.endpoint} (transport.base_port {config.base_port} + rank "
                f"{rank}, transport.bind_host): {e} (another run's trainer? pick a free transport.base_port)"
            ) from None
        self._buffer: dict[int, tuple[bytes, bytes]] = {}  # step -> (peer identity, payload), signed only
        # Steps are consumed in order: a resend of this step or an older one is acknowledged, not buffered (a set of
        # every consumed step would grow for the whole run).
        self._newest_consumed = -1
        self.num_dropped = 0
        self._drops_logged_at = -float("inf")
        self._drops_unlogged = 0

    def receive(self, step: int, *, timeout: float | None) -> tuple[RolloutBatchMeta, list[MicroBatch]]:
        zmq = _zmq()
        for old in [s for s in self._buffer if s < step]:  # the trainer moved past them (it resumed later)
            self._ack(self._buffer.pop(old)[0], old)
        start = last_log = time.monotonic()
        while step not in self._buffer:
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                raise TimeoutError(
                    f"trainer rank {self.rank}: no rollouts for step {step} on {self.endpoint} after {timeout:.0f}s"
                )
            if self.on_wait is not None and now - last_log >= self.log_every:
                self.on_wait(now - start)
                last_log = now
            if self._sock.poll(100, zmq.POLLIN):
                self._take(self._sock.recv_multipart(copy=False))
        peer, payload = self._buffer.pop(step)
        result = self._decode(step, payload)
        self._newest_consumed = max(self._newest_consumed, step)
        self._ack(peer, step)
        return result

    def _take(self, frames: list[Any]) -> None:
        """Buffer one signed message of a step still to come; acknowledge a signed resend of one consumed."""
        if len(frames) != 5 or frames[1].bytes != b"DATA":
            return self._drop(frames, f"{len(frames) - 1} frame(s), not a rollout message")
        raw_step = frames[2].bytes
        step = parse_step(raw_step)
        if step is None:
            return self._drop(frames, f"step {raw_step[:20]!r} is not a step number")
        if step in self._buffer:  # a resend of a batch already checked and held
            return None
        if not hmac.compare_digest(frames[3].bytes, mac(self.secret, b"DATA", self.rank, raw_step, frames[4].buffer)):
            return self._drop(frames, f"step {step} not signed with this run's secret for rank {self.rank}")
        peer = frames[0].bytes
        if step <= self._newest_consumed:
            return self._ack(peer, step)
        self._buffer[step] = (peer, frames[4].bytes)
        return None

    def _drop(self, frames: list[Any], why: str) -> None:
        """Count a message that is not this run's and name it in one line, at most once per ``log_every``."""
        self.num_dropped += 1
        self._drops_unlogged += 1
        now = time.monotonic()
        if now - self._drops_logged_at < self.log_every:
            return
        try:
            source = frames[-1].get("Peer-Address")
        except Exception:
            source = "an unknown peer"
        logger.warning(
            "trainer rank %d: dropped %d message(s) on %s that are not this run's (last from %s: %s); another run or "
            "a stale orchestrator on this port? only this run's orchestrator is trained on",
            self.rank,
            self._drops_unlogged,
            self.endpoint,
            source,
            why,
        )
        self._drops_logged_at, self._drops_unlogged = now, 0

    def _decode(self, step: int, payload: bytes) -> tuple[RolloutBatchMeta, list[MicroBatch]]:
        """The batch, or one line naming what is wrong with it (the sender had the secret: a bug, not an attack)."""
        try:
            meta, mbs = decode(payload)
        except Exception as e:
            raise UnreadableFile(
                f"trainer rank {self.rank}: the batch of step {step} does not decode: {first_line(e)}"
            ) from None
        if (meta.step, meta.rank) != (step, self.rank):
            raise UnreadableFile(
                f"trainer rank {self.rank}: the batch sent as step {step} holds step {meta.step} of rank {meta.rank}"
            )
        return meta, mbs

    def _ack(self, peer: bytes, step: int) -> None:
        raw_step = str(step).encode()
        self._sock.send_multipart([peer, b"ACK", raw_step, mac(self.secret, b"ACK", self.rank, raw_step)])

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()
