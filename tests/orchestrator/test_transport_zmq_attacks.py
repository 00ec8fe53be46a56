"""The zmq rollout transport under attack: what reaches the trainer is this run's orchestrator's batch, or nothing."""

import contextlib
import logging
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from prime_core.config.loader import ConfigError
from prime_core.config.orchestrator import OrchestratorConfig
from prime_core.io import UnreadableFile
from prime_core.run_dir import RunDir
from prime_core.transport import RolloutTransportConfig, make_receiver, make_sender
from prime_core.transport_zmq import encode

from tests.orchestrator.test_transport_zmq import batch, free_base_port


@pytest.fixture
def closing():
    """Closes what a test opened even when it fails: a zmq context left open hangs the process at exit."""
    opened = []
    yield opened.append
    for thing in reversed(opened):
        if hasattr(thing, "drain_timeout"):
            thing.drain_timeout = 0
        with contextlib.suppress(Exception):
            thing.close() if not isinstance(thing, zmq.Context) else thing.term()


def foreign(port: int, closing) -> zmq.Socket:
    ctx = zmq.Context()
    closing(ctx)
    sock = ctx.socket(zmq.DEALER)
    closing(sock)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def poisoned(step: int, rank: int = 0) -> bytes:
    """A well-formed batch for ``step`` whose tokens are not the run's (what a stale or foreign run would send)."""
    res = batch(step, ranks=rank + 1)
    res.micro_batches[rank][0].input_ids[:] = 666
    return encode(res.metas[rank], res.micro_batches[rank])


def the_runs_batch_arrives(cfg: RolloutTransportConfig, tmp_path, receiver, closing) -> None:
    """This run's orchestrator sends step 0; the rank returns exactly that batch."""
    sender = make_sender(cfg, RunDir(tmp_path), 1)
    closing(sender)
    good = batch(0, ranks=1)
    sender.send(0, 0, good.metas[0], good.micro_batches[0])
    _, mbs = receiver.receive(0, timeout=10)
    np.testing.assert_array_equal(mbs[0].input_ids, good.micro_batches[0][0].input_ids)


def listen_addresses(port: int) -> set[str]:
    """The local addresses this machine listens on ``port`` over TCP (from /proc/net/tcp, LISTEN entries)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:
                found.add(addr)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp")
def test_trainer_binds_loopback_unless_told(tmp_path, closing):
    port, other = free_base_port(), free_base_port()
    closing(make_receiver(RolloutTransportConfig(type="zmq", base_port=port), RunDir(tmp_path), 0))
    assert listen_addresses(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0
    cfg = RolloutTransportConfig(type="zmq", base_port=other, bind_host="0.0.0.0")
    closing(make_receiver(cfg, RunDir(tmp_path), 0))
    assert listen_addresses(other) == {"00000000"}


def test_another_runs_batch_for_the_awaited_step_is_not_trained_on(tmp_path, caplog, closing):
    """A second orchestrator (another run on the same port, or a stale one) sends a well-formed batch for the step the
    trainer waits for, first and many times: the trainer takes this run's batch and names the drops in one line."""
    cfg = RolloutTransportConfig(type="zmq", base_port=free_base_port())
    receiver = make_receiver(cfg, RunDir(tmp_path / "run"), 0)
    closing(receiver)
    intruder = make_sender(cfg, RunDir(tmp_path / "other-run"), 1)  # its own run dir: its own secret
    closing(intruder)
    bad = batch(0, ranks=1)
    bad.micro_batches[0][0].input_ids[:] = 666
    intruder.send(0, 0, bad.metas[0], bad.micro_batches[0])
    raw = foreign(cfg.base_port, closing)
    for _ in range(50):  # the unsigned layout of the old protocol, too
        raw.send_multipart([b"DATA", b"0", poisoned(0)])
    time.sleep(1.5)  # the intruders' copies are queued before the run's own
    sender = make_sender(cfg, RunDir(tmp_path / "run"), 1)
    closing(sender)
    good = batch(0, ranks=1)
    sender.send(0, 0, good.metas[0], good.micro_batches[0])
    with caplog.at_level(logging.WARNING, logger="prime.transport"):
        meta, mbs = receiver.receive(0, timeout=10)
    np.testing.assert_array_equal(mbs[0].input_ids, good.micro_batches[0][0].input_ids)
    # ZeroMQ queues fairly across connections: the run's batch may come before every intruder copy was read.
    assert receiver.num_dropped >= 1
    drops = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(drops) == 1 and "127.0.0.1" in drops[0] and "\n" not in drops[0], drops
    sender.drain_timeout = intruder.drain_timeout = 2
    sender.close()
    intruder.close()
    assert sender.num_unacked() == 0 and intruder.num_unacked() == 1  # never acknowledged


def test_stale_orchestrator_of_an_earlier_launch_is_refused(tmp_path, closing):
    """rl writes a fresh secret at every launch: an orchestrator left from the last launch of the same run dir, still
    sending, cannot feed the new trainer."""
    from prime_core.transport import new_transport_secret

    run_dir = RunDir(tmp_path)
    cfg = RolloutTransportConfig(type="zmq", base_port=free_base_port())
    new_transport_secret(run_dir)
    stale = make_sender(cfg, run_dir, 1)
    closing(stale)
    new_transport_secret(run_dir)  # the next launch
    assert (run_dir.root / "transport.secret").stat().st_mode & 0o777 == 0o600
    receiver = make_receiver(cfg, run_dir, 0)
    closing(receiver)
    sender = make_sender(cfg, run_dir, 1)
    closing(sender)
    bad, good = batch(0, ranks=1), batch(0, ranks=1)
    bad.micro_batches[0][0].input_ids[:] = 666
    stale.send(0, 0, bad.metas[0], bad.micro_batches[0])
    time.sleep(1.0)
    sender.send(0, 0, good.metas[0], good.micro_batches[0])
    _, mbs = receiver.receive(0, timeout=10)
    np.testing.assert_array_equal(mbs[0].input_ids, good.micro_batches[0][0].input_ids)
    assert receiver.num_dropped >= 1


def test_malformed_messages_are_dropped_not_raised(tmp_path, closing):
    cfg = RolloutTransportConfig(type="zmq", base_port=free_base_port())
    receiver = make_receiver(cfg, RunDir(tmp_path), 0)
    closing(receiver)
    raw = foreign(cfg.base_port, closing)
    for frames in (
        [b"x"],
        [b"DATA"],
        [b"DATA", b"0"],
        [b"DATA", b"zero", b"payload"],
        [b"DATA", b"-1", b"payload"],
        [b"DATA", b"9" * 5000, b"payload"],  # past int()'s digit limit
        [b"DATA", b"0", b"mac", b"\xff" * 10],  # a truncated payload
        [b"DATA", b"0", b"mac", (1 << 62).to_bytes(8, "little") + b"{}"],  # a huge declared header
    ):
        raw.send_multipart(frames)
    # Waiting for a step nobody sends: the rank reads (and drops) every malformed message meanwhile, raising none.
    with pytest.raises(TimeoutError):
        receiver.receive(0, timeout=3)
    assert receiver.num_dropped == 8
    sender = make_sender(cfg, RunDir(tmp_path), 1)
    closing(sender)
    good = batch(0, ranks=1)
    sender.send(0, 0, good.metas[0], good.micro_batches[0])
    meta, mbs = receiver.receive(0, timeout=10)
    assert meta.step == 0
    np.testing.assert_array_equal(mbs[0].input_ids, good.micro_batches[0][0].input_ids)


def test_batch_of_another_step_or_rank_is_one_line_error(tmp_path, closing):
    """The run's own orchestrator sending step 3's batch as step 5 (or rank 1's to rank 0): never trained on."""
    cfg = RolloutTransportConfig(type="zmq", base_port=free_base_port())
    receiver = make_receiver(cfg, RunDir(tmp_path), 0)
    closing(receiver)
    sender = make_sender(cfg, RunDir(tmp_path), 1)
    closing(sender)
    old = batch(3, ranks=2)
    sender.send(5, 0, old.metas[0], old.micro_batches[0])
    with pytest.raises(UnreadableFile, match=r"step 5 holds step 3") as e:
        receiver.receive(5, timeout=10)
    assert "\n" not in str(e.value)
    sender.send(6, 0, old.metas[1], old.micro_batches[1])
    with pytest.raises(UnreadableFile, match=r"rank 1"):
        receiver.receive(6, timeout=10)


def test_undecodable_batch_is_one_line_error(tmp_path, monkeypatch, closing):
    import prime_core.transport_zmq as tz

    cfg = RolloutTransportConfig(type="zmq", base_port=free_base_port())
    receiver = make_receiver(cfg, RunDir(tmp_path), 0)
    closing(receiver)
    sender = make_sender(cfg, RunDir(tmp_path), 1)
    closing(sender)
    monkeypatch.setattr(tz, "encode", lambda meta, mbs: b"\x05\x00\x00\x00\x00\x00\x00\x00{garbage")
    good = batch(0, ranks=1)
    sender.send(0, 0, good.metas[0], good.micro_batches[0])
    with pytest.raises(UnreadableFile, match=r"step 0 does not decode") as e:
        receiver.receive(0, timeout=10)
    assert "\n" not in str(e.value)


def test_port_taken_is_one_line_naming_the_field(tmp_path):
    port = free_base_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(ConfigError, match=r"transport\.base_port") as e:
            make_receiver(RolloutTransportConfig(type="zmq", base_port=port), RunDir(tmp_path), 0)
    assert str(port) in str(e.value) and "\n" not in str(e.value)


def test_sender_ignores_acks_of_whoever_holds_the_port(tmp_path, closing):
    """Something else on the trainer's port (a stale trainer, a squatter) acknowledging everything must not make the
    orchestrator drop batches as delivered."""
    cfg = RolloutTransportConfig(type="zmq", base_port=free_base_port())
    ctx = zmq.Context()
    closing(ctx)
    squatter = ctx.socket(zmq.ROUTER)
    closing(squatter)
    squatter.setsockopt(zmq.LINGER, 0)
    squatter.bind(f"tcp://127.0.0.1:{cfg.base_port}")
    sender = make_sender(cfg, RunDir(tmp_path), 1)
    closing(sender)
    good = batch(0, ranks=1)
    sender.send(0, 0, good.metas[0], good.micro_batches[0])
    assert squatter.poll(10_000)
    peer, *frames = squatter.recv_multipart()
    squatter.send_multipart([peer, b"ACK", frames[1]])
    squatter.send_multipart([peer, b"ACK", frames[1], b"\0" * 32])
    time.sleep(0.5)
    assert sender.num_unacked() == 1


def test_orchestrator_spreads_ranks_over_trainer_hosts(closing):
    with pytest.raises(ValueError, match=r"transport\.host names 2 trainer node"):
        OrchestratorConfig(num_trainer_ranks=3, transport=RolloutTransportConfig(type="zmq", host="a,b"))
    for blank in ("a,,b", "a,", " ", "a b"):  # a rank's batches would go to no host, or to an unresolvable name
        with pytest.raises(ValueError, match=r"every comma-separated host must be a name"):
            RolloutTransportConfig(type="zmq", host=blank)
    from prime_core.transport_zmq import ZmqSender

    cfg = RolloutTransportConfig(type="zmq", host="node-a,node-b", base_port=40000)
    sender = ZmqSender(cfg, 4, b"s" * 32)
    closing(sender)
    assert sender._endpoints == [
        "tcp://node-a:40000",
        "tcp://node-a:40001",
        "tcp://node-b:40002",
        "tcp://node-b:40003",
    ]


def test_sender_refuses_a_batch_over_the_message_limit(tmp_path, monkeypatch, closing):
    import prime_core.transport_zmq as tz

    cfg = RolloutTransportConfig(type="zmq", base_port=free_base_port(), max_message_mb=1)
    sender = make_sender(cfg, RunDir(tmp_path), 1)
    closing(sender)
    monkeypatch.setattr(tz, "encode", lambda meta, mbs: b"x" * (2 << 20))
    res = batch(0, ranks=1)
    with pytest.raises(ValueError, match=r"2 MiB, over transport\.max_message_mb \(1\)"):
        sender.send(0, 0, res.metas[0], res.micro_batches[0])
    assert sender.num_unacked() == 0


def test_oversized_message_is_never_read_into_memory(tmp_path, closing):
    """A peer declaring a frame over max_message_mb is disconnected by zmq before the payload is read."""
    cfg = RolloutTransportConfig(type="zmq", base_port=free_base_port(), max_message_mb=1)
    receiver = make_receiver(cfg, RunDir(tmp_path), 0)
    closing(receiver)
    raw = foreign(cfg.base_port, closing)
    raw.send_multipart([b"DATA", b"0", b"\0" * 32, b"\0" * (8 << 20)])
    time.sleep(1.0)
    the_runs_batch_arrives(cfg, tmp_path, receiver, closing)
    assert receiver.num_dropped == 0  # never handed to Python at all


def test_sender_does_not_pile_copies_on_a_busy_trainer(tmp_path, closing):
    """While a rank trains it reads nothing: every copy the orchestrator sends meanwhile is held in the trainer's
    memory (20 s steps of 100 MB batches, two steps ahead, resent every second: 4 GB). One copy per step, unless the
    connection drops."""
    cfg = RolloutTransportConfig(type="zmq", base_port=free_base_port())
    ctx = zmq.Context()
    closing(ctx)
    trainer = ctx.socket(zmq.ROUTER)  # a busy rank: takes nothing, acknowledges nothing
    closing(trainer)
    trainer.setsockopt(zmq.LINGER, 0)
    trainer.bind(f"tcp://127.0.0.1:{cfg.base_port}")
    sender = make_sender(cfg, RunDir(tmp_path), 1)
    closing(sender)
    for step in (1, 2):
        res = batch(step, ranks=1)
        sender.send(step, 0, res.metas[0], res.micro_batches[0])
    time.sleep(4.0)
    copies = 0
    while trainer.poll(200):
        trainer.recv_multipart()
        copies += 1
    assert copies == 2


def test_a_batch_signed_for_another_rank_is_dropped(tmp_path, closing):
    """The signature covers the rank: rank 1's batch arriving on rank 0's port (a mis-set base_port, a replay) is not
    trained on by rank 0."""
    from prime_core.transport import transport_secret
    from prime_core.transport_zmq import mac

    cfg = RolloutTransportConfig(type="zmq", base_port=free_base_port())
    receiver = make_receiver(cfg, RunDir(tmp_path), 0)
    closing(receiver)
    raw = foreign(cfg.base_port, closing)
    payload = poisoned(0, rank=1)
    raw.send_multipart([b"DATA", b"0", mac(transport_secret(RunDir(tmp_path)), b"DATA", 1, b"0", payload), payload])
    time.sleep(0.5)
    the_runs_batch_arrives(cfg, tmp_path, receiver, closing)
    assert receiver.num_dropped == 1
