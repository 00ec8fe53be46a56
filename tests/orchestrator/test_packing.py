import random

import numpy as np
import pytest
from prime_core.run_dir import RunDir
from prime_core.schemas.microbatch import read_microbatches
from prime_core.transport import FilesystemSender
from prime_orchestrator.packing import Sample, balance_across_ranks, first_fit_decreasing, pack


def make_samples(n, seed=0, max_len=60):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(3, max_len)
        prompt = rng.randint(1, length - 1)
        out.append(
            Sample(
                token_ids=[(i * 7 + t) % 97 + 1 for t in range(length)],
                loss_mask=[t >= prompt for t in range(length)],
                logprobs=[-0.1 * (t >= prompt) for t in range(length)],
                advantage=rng.uniform(-1, 1),
                weight_step=i % 3,
            )
        )
    return out


def test_ffd_never_splits_or_overflows():
    lengths = [random.Random(1).randint(1, 64) for _ in range(200)]
    bins = first_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)


def test_balance_within_one_sample():
    rng = random.Random(2)
    lengths = [rng.randint(1, 100) for _ in range(97)]
    for ranks in (2, 3, 4):
        loads = [sum(lengths[i] for i in idx) for idx in balance_across_ranks(lengths, ranks)]
        assert max(loads) - min(loads) <= max(lengths)


def test_pack_roundtrip_every_token_once(tmp_path):
    samples = make_samples(40)
    res = pack(samples, step=3, seq_len=64, num_ranks=2, micro_batch_rows=2, temperature=0.7)
    assert len({len(m) for m in res.micro_batches}) == 1  # same num_micro_batches on every rank
    seen = []
    for rank, mbs in enumerate(res.micro_batches):
        meta = res.metas[rank]
        assert meta.global_num_samples == 40 and meta.temperature == 0.7
        assert meta.global_loss_tokens == sum(sum(s.loss_mask) for s in samples)
        for mb in mbs:
            assert mb.shape == (2, 64)
            for row in range(2):
                sids = mb.sample_ids[row]
                for sid in set(sids.tolist()) - {-1}:
                    pos = np.where(sids == sid)[0]
                    assert (np.diff(pos) == 1).all()  # contiguous: never split
                    assert (mb.position_ids[row, pos] == np.arange(len(pos))).all()
                    toks = mb.input_ids[row, pos].tolist()
                    seen.append((meta.weight_steps[sid], tuple(toks)))
    expected = sorted((s.weight_step, tuple(s.token_ids)) for s in samples)
    assert sorted(seen) == expected
    # atomic files through the filesystem sender, readable back
    sender = FilesystemSender(RunDir(tmp_path))
    for r in range(2):
        sender.send(3, r, res.metas[r], res.micro_batches[r])
    files = sorted(p.name for p in (tmp_path / "rollouts" / "step_3").iterdir())
    assert files == ["rank_0.safetensors", "rank_1.safetensors"]  # no temporary leftovers
    meta, mbs = read_microbatches(tmp_path / "rollouts" / "step_3" / "rank_1.safetensors")
    assert meta.rank == 1 and len(mbs) == meta.num_micro_batches


def test_long_samples_truncated_or_dropped():
    samples = make_samples(5, max_len=30) + [Sample(list(range(1, 101)), [True] * 100, [0.0] * 100, 1.0, 0)]
    t = pack(samples, step=0, seq_len=64, num_ranks=1, micro_batch_rows=1, temperature=1.0)
    assert (t.num_truncated, t.num_dropped) == (1, 0) and t.metas[0].global_num_samples == 6
    d = pack(samples, step=0, seq_len=64, num_ranks=1, micro_batch_rows=1, temperature=1.0, long_samples="drop")
    assert (d.num_truncated, d.num_dropped) == (0, 1) and d.metas[0].global_num_samples == 5


def test_sample_extra_lands_in_every_micro_batch_aligned_with_its_tokens():
    """A producer's per-token array (here a fake teacher log-prob per token) reaches the micro-batches under its name:
    on its sample's tokens, zero elsewhere, cut with the sample, and present on ranks and rows without samples."""
    samples = make_samples(7, max_len=30)
    for i, s in enumerate(samples):
        s.extra = {"teacher_logprobs": [-(i + 1) - t / 100 for t in range(len(s))]}
    samples.append(Sample(list(range(1, 81)), [True] * 80, [0.0] * 80, 1.0, 0, extra={"teacher_logprobs": [-9.0] * 80}))
    res = pack(samples, step=0, seq_len=64, num_ranks=3, micro_batch_rows=3, temperature=1.0)
    assert res.num_truncated == 1
    found = {}
    for rank, mbs in enumerate(res.micro_batches):
        for mb in mbs:
            extra = mb.extra["teacher_logprobs"]
            assert extra.shape == mb.shape and extra.dtype == np.float32
            assert not extra[mb.sample_ids < 0].any()
            for row, t in zip(*np.nonzero(mb.sample_ids >= 0), strict=True):
                found.setdefault((rank, int(mb.sample_ids[row, t])), []).append(float(extra[row, t]))
    expected = sorted(round(v, 4) for s in samples for v in np.asarray(s.extra["teacher_logprobs"][:64], np.float32))
    assert sorted(round(v, 4) for vs in found.values() for v in vs) == expected
    with pytest.raises(ValueError, match=r"sample extra 'x' has shape \(2,\), expected \(3,\)"):
        pack([Sample([1, 2, 3], [0, 1, 1], [0, 0, 0], 1.0, 0, extra={"x": [1, 2]})], step=0, seq_len=8, num_ranks=1,
             micro_batch_rows=1, temperature=1.0)  # fmt: skip


def test_empty_step_still_ships_one_micro_batch_per_rank():
    res = pack([], step=0, seq_len=16, num_ranks=2, micro_batch_rows=1, temperature=1.0)
    assert [len(m) for m in res.micro_batches] == [1, 1]
    assert res.micro_batches[0][0].num_loss_tokens == 0


def test_a_sample_that_sampled_an_image_placeholder_is_dropped():
    from types import SimpleNamespace

    from prime_orchestrator.packing import fit_to_seq_len

    vision = SimpleNamespace(image_token_id=99, vision_start_token_id=98)
    prompt_image = Sample([98, 99, 99, 5, 6], [False, False, False, False, True], [0.0] * 5, 1.0, 0, images=["x"])
    sampled_pad = Sample([5, 6, 99], [False, True, True], [0.0, -0.1, -0.1], 1.0, 0)
    kept, truncated, dropped = fit_to_seq_len([prompt_image, sampled_pad], 64, "truncate", vision)
    assert kept == [prompt_image] and (truncated, dropped) == (0, 1)


def test_a_seq_len_shorter_than_every_prompt_is_named_not_trained_on():
    """Before, truncation kept the prompt tokens alone: the run finished every step training on nothing (seen with
    ``rl @ examples/arithmetic/rl.toml --seq-len 16``: loss 0, rc 0). Now the step is a one-line fault."""
    from prime_orchestrator.packing import seq_len_too_short

    samples = make_samples(8, max_len=60)
    first = min(s.loss_mask.index(True) for s in samples)
    assert seq_len_too_short(samples, first + 1) is None  # one trained token still fits
    assert seq_len_too_short(samples, first) == (
        f"every prompt fills seq_len ({first}) (the shortest is {first} tokens): no sample keeps a trained token; "
        "raise seq_len"
    )
    packed = pack(samples, step=0, seq_len=first, num_ranks=1, micro_batch_rows=1, temperature=1.0)
    assert packed.metas[0].global_loss_tokens == 0  # what the trainer would have been given
    assert seq_len_too_short([], 8) is None
