import socket

import numpy as np
from prime_core.run_dir import RunDir
from prime_core.transport import RolloutTransportConfig, make_receiver, make_sender
from prime_orchestrator.packing import Sample, pack


def free_base_port() -> int:
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def batch(step, ranks=2):
    samples = [Sample([1, 2, 3, step + 4], [False, True, True, True], [0, -0.1, -0.2, -0.3], 0.5, step)] * 3
    return pack(samples, step=step, seq_len=8, num_ranks=ranks, micro_batch_rows=1, temperature=1.0)


def test_zmq_two_ranks_with_receiver_restart(tmp_path):
    cfg = RolloutTransportConfig(type="zmq", base_port=free_base_port())
    run_dir = RunDir(tmp_path)
    receivers = [make_receiver(cfg, run_dir, r) for r in range(2)]
    sender = make_sender(cfg, run_dir, 2)
    sent = {}
    for step in range(4):
        res = batch(step)
        sent[step] = res
        for r in range(2):
            sender.send(step, r, res.metas[r], res.micro_batches[r])
    for step in range(2):
        for r in range(2):
            meta, mbs = receivers[r].receive(step, timeout=30)
            assert meta.step == step and meta.rank == r
            assert len(mbs) == sent[step].metas[r].num_micro_batches
            np.testing.assert_array_equal(mbs[0].input_ids, sent[step].micro_batches[r][0].input_ids)
    # rank 1 crashes before consuming steps 2 and 3, and comes back on the same port
    receivers[1].close()
    receivers[1] = make_receiver(cfg, run_dir, 1)
    for step in (2, 3):
        for r in range(2):
            meta, mbs = receivers[r].receive(step, timeout=30)
            assert (meta.step, meta.rank) == (step, r)
            np.testing.assert_array_equal(mbs[0].loss_mask, sent[step].micro_batches[r][0].loss_mask)
    sender.drain_timeout = 10
    sender.close()
    assert sender.num_unacked() == 0
    for r in receivers:
        r.close()


def test_zmq_receiver_keeps_no_state_per_consumed_step(tmp_path):
    """A run of days consumes a step after another: what the receiver holds stays the same size, and a resend of a
    step it consumed long ago is still acknowledged (the sender drains)."""
    cfg = RolloutTransportConfig(type="zmq", base_port=free_base_port())
    receiver = make_receiver(cfg, RunDir(tmp_path), 0)
    sender = make_sender(cfg, RunDir(tmp_path), 1)

    def held() -> int:
        return sum(len(v) for v in vars(receiver).values() if isinstance(v, set | dict | list))

    sizes = {}
    for step in range(200):
        res = batch(step, ranks=1)
        sender.send(step, 0, res.metas[0], res.micro_batches[0])
        receiver.receive(step, timeout=30)
        sizes[step] = held()
    assert sizes[199] == sizes[10], sizes
    old, res = batch(3, ranks=1), batch(200, ranks=1)
    sender.send(3, 0, old.metas[0], old.micro_batches[0])  # a late resend of an old step
    sender.send(200, 0, res.metas[0], res.micro_batches[0])
    receiver.receive(200, timeout=30)
    sender.drain_timeout = 10
    sender.close()
    assert sender.num_unacked() == 0 and held() == sizes[10]
    receiver.close()
