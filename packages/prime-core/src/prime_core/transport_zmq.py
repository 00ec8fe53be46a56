"""ZMQ rollout transport: the orchestrator sends each trainer rank its micro-batches over TCP.

Trainer rank ``r`` binds a ROUTER on ``tcp://*:base_port + r``; the orchestrator connects a DEALER to
``host:base_port + r`` per rank. A message is ``[b"DATA", step, payload]`` where the payload is the same
safetensors bytes as the filesystem transport's file. The receiver answers ``[b"ACK", step]`` once
``receive(step)`` hands the batch to the trainer; the sender re-sends every unacknowledged step every
``resend_interval`` seconds, so a receiver that restarts mid-run still gets what it had not consumed (ZMQ
reconnects the DEALER by itself). Duplicates are acknowledged and dropped. ``import zmq`` happens here only.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any

import numpy as np

from prime_core.schemas.microbatch import (
    MICROBATCH_SCHEMA_VERSION,
    MicroBatch,
    RolloutBatchMeta,
    microbatch_from_tensors,
    microbatch_tensors,
)


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
    return save(tensors, metadata={"prime": meta.model_dump_json()})


def decode(payload: bytes) -> tuple[RolloutBatchMeta, list[MicroBatch]]:
    from safetensors import safe_open  # noqa: F401  (same dependency as the file reader)
    from safetensors.numpy import load

    header_len = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + header_len])
    data = json.loads(header["__metadata__"]["prime"])
    if data.get("schema_version") != MICROBATCH_SCHEMA_VERSION:
        raise ValueError(
            f"micro-batch schema version {data.get('schema_version')}, expected {MICROBATCH_SCHEMA_VERSION}"
        )
    meta = RolloutBatchMeta.model_validate(data)
    tensors = load(payload)
    return meta, [microbatch_from_tensors(i, tensors) for i in range(meta.num_micro_batches)]


class ZmqSender:
    """Orchestrator side. ``send`` queues; a background thread owns the sockets, resends and reads acks."""

    def __init__(self, config: Any, num_ranks: int, *, resend_interval: float = 1.0, drain_timeout: float = 600.0):
        zmq = _zmq()
        self.num_ranks = num_ranks
        self.resend_interval = resend_interval
        self.drain_timeout = drain_timeout
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._outbox: list[tuple[int, int, bytes]] = []  # (rank, step, payload) not yet handed to the thread
        self._unacked: dict[tuple[int, int], tuple[bytes, float]] = {}
        self._stop = threading.Event()
        self._endpoints = [f"tcp://{config.host}:{config.base_port + r}" for r in range(num_ranks)]
        self._thread = threading.Thread(target=self._loop, name="zmq-sender", daemon=True)
        self._thread.start()

    def send(self, step: int, rank: int, meta: RolloutBatchMeta, micro_batches: list[MicroBatch]) -> None:
        payload = encode(meta, micro_batches)
        with self._lock:
            self._outbox.append((rank, step, payload))

    def num_unacked(self) -> int:
        with self._lock:
            return len(self._unacked) + len(self._outbox)

    def _loop(self) -> None:
        zmq = _zmq()
        socks = []
        poller = zmq.Poller()
        for ep in self._endpoints:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RECONNECT_IVL, 100)
            s.connect(ep)
            poller.register(s, zmq.POLLIN)
            socks.append(s)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                with self._lock:
                    fresh, self._outbox = self._outbox, []
                    for rank, step, payload in fresh:
                        self._unacked[(rank, step)] = (payload, 0.0)
                    due = [(k, p) for k, (p, t) in self._unacked.items() if now - t >= self.resend_interval]
                    for k, p in due:
                        self._unacked[k] = (p, now)
                for (rank, step), payload in due:
                    with contextlib.suppress(zmq.Again):
                        socks[rank].send_multipart([b"DATA", str(step).encode(), payload], flags=zmq.NOBLOCK)
                for sock, _ in poller.poll(50):
                    while True:
                        try:
                            frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if frames[0] == b"ACK":
                            rank = socks.index(sock)
                            with self._lock:
                                self._unacked.pop((rank, int(frames[1])), None)
        finally:
            for s in socks:
                s.close(0)

    def close(self) -> None:
        """Wait (up to drain_timeout) until every rank acknowledged every step, then stop."""
        deadline = time.monotonic() + self.drain_timeout
        while self.num_unacked() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.num_unacked()
        self._stop.set()
        self._thread.join()
        self._ctx.term()
        if left:
            import logging

            logging.getLogger("prime.transport").warning("zmq sender closed with %d unacknowledged batches", left)


class ZmqReceiver:
    """Trainer side (rank ``rank``): binds ``base_port + rank`` and returns the batch of a requested step."""

    def __init__(self, config: Any, rank: int, on_wait=None, *, log_every: float = 30.0):
        zmq = _zmq()
        self.rank = rank
        self.on_wait = on_wait
        self.log_every = log_every
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.bind(f"tcp://*:{config.base_port + rank}")
        self._buffer: dict[int, tuple[bytes, bytes]] = {}  # step -> (peer identity, payload)
        # Steps are consumed in order: a resend of this step or an older one is acknowledged, not buffered (a set of
        # every consumed step would grow for the whole run).
        self._newest_consumed = -1

    def receive(self, step: int, *, timeout: float | None) -> tuple[RolloutBatchMeta, list[MicroBatch]]:
        zmq = _zmq()
        start = last_log = time.monotonic()
        while step not in self._buffer:
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                raise TimeoutError(
                    f"trainer rank {self.rank}: no rollouts for step {step} over zmq after {timeout:.0f}s"
                )
            if self.on_wait is not None and now - last_log >= self.log_every:
                self.on_wait(now - start)
                last_log = now
            if not self._sock.poll(100, zmq.POLLIN):
                continue
            peer, kind, raw_step, *rest = self._sock.recv_multipart()
            if kind != b"DATA":
                continue
            got = int(raw_step)
            if got <= self._newest_consumed:
                self._sock.send_multipart([peer, b"ACK", raw_step])
            else:
                self._buffer[got] = (peer, rest[0])
        peer, payload = self._buffer.pop(step)
        result = decode(payload)
        self._newest_consumed = max(self._newest_consumed, step)
        self._sock.send_multipart([peer, b"ACK", str(step).encode()])
        return result

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()
