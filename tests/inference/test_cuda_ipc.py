"""The CUDA IPC weight transport, everything but the GPU: the store protocol between trainer and inference (buckets,
acknowledgements, at most two buckets out, failures and timeouts on both sides), the handle as plain data against
torch's ``rebuild_cuda_tensor``, and the checks on what the store hands over. On CPU the two IPC calls (share on
the trainer, open on inference) are replaced by an in-process registry; tests/inference/test_weight_transports_gpu.py
runs the real thing on a GPU."""

from __future__ import annotations

import base64
import threading
import time

import httpx
import pytest
import torch
from prime_core.config import ConfigError
from prime_core.config.trainer import TrainerConfig, WeightBroadcastConfig
from prime_core.io import atomic_dir
from prime_core.run_dir import RunDir
from prime_core.schemas.weights import CudaIpcBucket, CudaIpcHandle, CudaIpcManifest, write_manifest
from prime_inference.weights import cuda_ipc as receiving
from prime_inference.weights.cuda_ipc import CudaIpcError, CudaIpcReceiver
from prime_models import load_model
from prime_models.checkpoint import hf_state_dict
from prime_trainer.weights import cuda_ipc as sending
from prime_trainer.weights.cuda_ipc import CudaIpcPublisher, CudaIpcSender, CudaIpcTimeout
from prime_trainer.world import World

from tests.inference.helpers import start_server
from tests.tiny import free_port

CPU = torch.device("cpu")
CPU_WORLD = World(rank=0, world_size=1, local_rank=0, device=CPU)


class FakeIpc:
    """Stands in for CUDA IPC in one process: ``share`` files the buffer under a handle, ``open`` finds it."""

    def __init__(self, monkeypatch):
        self.buffers: dict[bytes, torch.Tensor] = {}
        self.opened = 0
        self.on_share = None
        monkeypatch.setattr(sending, "share", self.share)
        monkeypatch.setattr(receiving, "open_handle", self.open)
        for module in (sending, receiving):
            monkeypatch.setattr(module, "gpu_uuid", lambda device: "GPU-test")

    def share(self, flat: torch.Tensor) -> CudaIpcHandle:
        if self.on_share is not None:
            self.on_share(len(self.buffers))
        handle = f"buffer-{len(self.buffers)}".encode()
        self.buffers[handle] = flat
        raw = base64.b64encode(handle).decode()
        return CudaIpcHandle(storage_handle=raw, storage_size_bytes=flat.numel() * flat.element_size(),
                             storage_offset_bytes=0, ref_counter_handle=raw, ref_counter_offset=0, event_handle=None,
                             event_sync_required=False)  # fmt: skip

    def open(self, handle: CudaIpcHandle, dtype, numel, device) -> torch.Tensor:
        self.opened += 1
        flat = self.buffers[base64.b64decode(handle.storage_handle)]
        assert flat.dtype == dtype and flat.numel() == numel
        return flat


def sender(timeout_s: float = 20, workers: int = 1, bucket_bytes: int = 4096) -> CudaIpcSender:
    config = WeightBroadcastConfig(type="cuda_ipc", port=free_port(), timeout_s=timeout_s, inference_workers=workers)
    s = CudaIpcSender(config, CPU_WORLD)
    s._bucket_bytes = lambda: bucket_bytes  # a tiny model in several buckets
    return s


def receive(manifest: CudaIpcManifest, into: dict, errors: list, slow_s: float = 0.0) -> threading.Thread:
    def run() -> None:
        try:
            for bucket in CudaIpcReceiver().tensors(manifest, CPU):
                into.update({name: t.clone() for name, t in bucket})  # what an engine does: copy, then ask for more
                time.sleep(slow_s)
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def tiny_model(model_dir):
    return load_model(model_dir)


def test_every_tensor_arrives_exactly_with_at_most_two_buckets_out(monkeypatch, model_dir):
    ipc = FakeIpc(monkeypatch)
    s = sender()
    manifest = s.manifest(1)
    assert manifest.gpu_uuid == "GPU-test" and manifest.num_workers == 1
    out_at_share = []
    ipc.on_share = lambda i: out_at_share.append(
        i - sum(s.store.check([sending.key(1, "taken", j, 0)]) for j in range(i))
    )
    got, errors = {}, []
    thread = receive(manifest, got, errors, slow_s=0.01)
    model = tiny_model(model_dir)
    timings = s.send(model, None, 1)
    thread.join(timeout=30)
    assert not errors
    expected = dict(hf_state_dict(model))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert len(ipc.buffers) > 3 and max(out_at_share) <= 2  # never more than two buckets shared and not yet taken
    assert timings["bytes"] == sum(t.numel() * t.element_size() for t in expected.values())
    # The store forgets a finished step; the next step goes over the same store.
    assert not s.store.check([sending.key(1, "bucket", 0)])
    got2, errors = {}, []
    thread = receive(s.manifest(2), got2, errors)
    s.send(model, None, 2)
    thread.join(timeout=30)
    assert not errors and got2.keys() == expected.keys()


def test_waiting_for_a_busy_inference_writes_nothing_to_the_log(monkeypatch, model_dir, capfd):
    """Each store wait that times out logs two C++ warnings: waiting in 50 ms waits put 40 lines a second into the
    trainer's log for as long as inference was busy (270 of 288 lines of a 10-step log on an H200)."""
    FakeIpc(monkeypatch)
    s = sender()
    manifest = s.manifest(1)
    got, errors = {}, []
    late = threading.Timer(1.0, lambda: receive(manifest, got, errors).join(timeout=30))  # inference busy for 1 s
    late.start()
    s.send(tiny_model(model_dir), None, 1)
    late.join(timeout=30)
    assert not errors and got
    assert "waitForInput" not in capfd.readouterr().err


def test_a_failing_engine_fails_the_trainer_at_once(monkeypatch, model_dir):
    FakeIpc(monkeypatch)
    s = sender(timeout_s=30)
    manifest = s.manifest(1)

    def engine() -> None:
        for _ in CudaIpcReceiver().tensors(manifest, CPU):
            raise ValueError("shape mismatch")  # the engine's load failed on the first bucket

    thread = threading.Thread(target=lambda: pytest.raises(ValueError, engine))
    thread.start()
    t0 = time.perf_counter()
    with pytest.raises(CudaIpcTimeout, match="inference failed to take bucket 0 of step 1: the engine stopped"):
        s.send(tiny_model(model_dir), None, 1)
    assert time.perf_counter() - t0 < 10
    thread.join(timeout=10)


def test_a_failing_trainer_ends_the_receivers_step_with_its_error(monkeypatch, model_dir):
    FakeIpc(monkeypatch)
    s = sender()
    model = tiny_model(model_dir)

    def broken(model, **kwargs):
        yield from list(hf_state_dict(model))[:3]
        raise RuntimeError("gather failed")

    monkeypatch.setattr(sending, "hf_state_dict", broken)
    got, errors = {}, []
    thread = receive(s.manifest(1), got, errors)
    with pytest.raises(RuntimeError, match="gather failed"):
        s.send(model, None, 1)
    thread.join(timeout=30)
    assert len(errors) == 1 and isinstance(errors[0], CudaIpcError)
    assert "the trainer failed handing over step 1: RuntimeError: gather failed" in str(errors[0])


def test_both_sides_give_up_within_their_timeout(monkeypatch, model_dir):
    FakeIpc(monkeypatch)
    s = sender(timeout_s=1.5)
    manifest = s.manifest(1)
    t0 = time.perf_counter()
    with pytest.raises(
        CudaIpcTimeout, match=rf"did not take bucket 0 of step 1 from the store at 127.0.0.1:{s.config.port}"
    ):
        s.send(tiny_model(model_dir), None, 1)
    assert time.perf_counter() - t0 < 8
    t0 = time.perf_counter()
    with pytest.raises(CudaIpcError, match="the trainer handed over no bucket 0 of step 7"):
        list(CudaIpcReceiver().tensors(manifest.model_copy(update={"step": 7}), CPU))
    assert time.perf_counter() - t0 < 8


def test_a_worker_on_another_gpu_or_the_cpu_refuses(model_dir):
    manifest = CudaIpcManifest(step=1, host="127.0.0.1", port=free_port(), num_workers=1, gpu_uuid="GPU-abc",
                               timeout_s=1)  # fmt: skip
    with pytest.raises(CudaIpcError, match="GPU memory of GPU-abc; this worker runs on cpu: trainer and inference"):
        list(CudaIpcReceiver().tensors(manifest, CPU))


@pytest.mark.parametrize(
    "bucket,message",
    [
        (dict(dtype="cuda", numel=4), "names no torch dtype"),
        (dict(dtype="float32", numel=4096), "exceeds its allocation"),
        (dict(dtype="float32", numel=4, tensors=[("w", [2, 2], 2)]), r"w \[2, 2\] at 2 is outside its buffer"),
        (dict(dtype="float32", numel=4, tensors=[("w", [-1, 8], 0)]), "outside its buffer"),
    ],
)
def test_what_the_store_hands_over_is_checked_before_anything_is_opened(monkeypatch, bucket, message):
    ipc = FakeIpc(monkeypatch)
    handle = ipc.share(torch.zeros(4))
    with pytest.raises(CudaIpcError, match=message):
        receiving.views(CudaIpcBucket(index=0, handle=handle, **bucket), CPU)
    assert ipc.opened == 0


def test_the_handle_is_plain_data_for_torchs_rebuild(monkeypatch):
    """share() turns torch's ``_share_cuda_`` tuple into JSON-able data; open_handle() gives rebuild_cuda_tensor
    exactly the arguments ``reduce_tensor`` would have (with this worker's device index)."""
    raw = (0, b"\x01handle\xff", 4096, 512, b"/torch_ref", 8, b"\x02event", True)

    class Storage:
        def _share_cuda_(self):
            return raw

    class Flat:
        def untyped_storage(self):
            return Storage()

    handle = CudaIpcHandle.model_validate_json(sending.share(Flat()).model_dump_json())
    seen = {}
    monkeypatch.setattr("torch.multiprocessing.reductions.rebuild_cuda_tensor", lambda *a: seen.setdefault("a", a))
    receiving.open_handle(handle, torch.bfloat16, 100, torch.device("cuda", 3))
    a = seen["a"]
    assert a[1:4] == ((100,), (1,), 0) and a[5:8] == (torch.bfloat16, 3, raw[1])
    assert a[8:10] == (4096, 512) and a[10] is False and a[11:15] == (raw[4], 8, raw[6], True)


def test_the_trainer_refuses_cuda_ipc_on_cpu(tmp_path):
    config = TrainerConfig.model_validate({"output_dir": str(tmp_path), "weights": {"broadcast": {"type": "cuda_ipc"}}})
    with pytest.raises(ConfigError, match="'cuda_ipc' shares GPU memory; the trainer runs on cpu"):
        CudaIpcPublisher.build(RunDir(tmp_path), CPU_WORLD, config, keep_all=False, tokenizer="t", adapter=None)


def test_the_server_answers_504_and_keeps_serving(tmp_path, model_dir):
    """A torch-engine server on CPU cannot open GPU memory: one line naming why, the old weights stay."""
    server = start_server(model_dir)
    try:
        manifest = CudaIpcManifest(step=1, host="127.0.0.1", port=free_port(), num_workers=1, gpu_uuid="GPU-abc",
                                   timeout_s=2)  # fmt: skip
        with atomic_dir(tmp_path / "step_1") as tmp:
            write_manifest(tmp, manifest)
        r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(tmp_path / "step_1"), "step": 1})
        assert r.status_code == 504, r.text
        assert "cuda_ipc weights of" in r.json()["error"]["message"] and "this worker runs on cpu" in r.text
        assert httpx.get(f"{server.url}/health").json()["weight_step"] == 0
    finally:
        server.stop()
