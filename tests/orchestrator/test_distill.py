"""On-policy distillation: the per-token signal is the reverse KL to the teacher on the student's sampled tokens,
mixed with the task advantage by weights, and a teacher with another tokenizer is a one-line error at start."""

import asyncio

import httpx
import numpy as np
import pytest
from prime_core.config.distill import DistillConfig, TeacherConfig
from prime_core.config.orchestrator import OrchestratorConfig
from prime_core.schemas.microbatch import read_microbatches
from prime_core.schemas.rollout import TrainedSequence
from prime_orchestrator.distill import Teacher, Teachers, TokenizerMismatch, _covered, check_tokenizer
from prime_orchestrator.packing import Sample, fit_to_seq_len

from tests.orchestrator.conftest import CORPUS, TorchServer, build_model
from tests.orchestrator.test_integration import make_config, run
from tests.tiny import build_chatml_tokenizer


def distill(url="http://127.0.0.1:1", model="teacher", **kwargs) -> DistillConfig:
    return DistillConfig(teacher=TeacherConfig(base_url=url + "/v1/", model=model), **kwargs)


def test_signal_mixes_reverse_kl_and_task_advantage():
    seq = TrainedSequence(
        token_ids=[1, 2, 3, 4],
        loss_mask=[False, True, False, True],
        logprobs=[0.0, -0.5, 0.0, -2.0],
        teacher_logprobs=[0.0, -1.5, -0.3, -0.25],
    )
    teacher = Teacher("env", distill(kl_weight=2.0, reward_weight=0.5))
    # Sampled tokens: -k = log p_teacher - log p_student = -1.0 and +1.75; prompt/env tokens carry nothing.
    assert teacher.advantages(seq, 0.4) == pytest.approx([0.0, 0.5 * 0.4 + 2.0 * -1.0, 0.0, 0.5 * 0.4 + 2.0 * 1.75])
    assert teacher.config.teacher.base_url == "http://127.0.0.1:1"
    teachers = Teachers(OrchestratorConfig(env=[{"id": "a", "distill": distill().model_dump()}, {"id": "b"}]))
    assert teachers.distils("a") and not teachers.distils("b")
    assert teachers.advantage("b", seq, 0.4) == 0.4  # RL env: the group advantage, unchanged


def test_truncation_cuts_per_token_advantages():
    s = Sample([1, 2, 3, 4], [False, True, True, True], [0.0, -1.0, -1.0, -1.0], [0.0, 0.1, 0.2, 0.3], 0)
    (kept,), truncated, _ = fit_to_seq_len([s], 3, "truncate")
    assert truncated == 1 and kept.advantage == [0.0, 0.1, 0.2]


def test_tokenizer_mismatch_is_one_line(tmp_path):
    student = build_model(tmp_path / "student")
    other = build_chatml_tokenizer(["completely different words here", "zebra yak quokka"] * 20, vocab_size=300)
    other.save_pretrained(tmp_path / "other")
    bad = TeacherConfig(base_url="http://127.0.0.1:1", model="t", tokenizer=str(tmp_path / "other"))
    same = bad.model_copy(update={"tokenizer": str(student)})

    async def check(teacher):
        async with httpx.AsyncClient() as client:
            await check_tokenizer(str(student), teacher, client)

    with pytest.raises(TokenizerMismatch) as e:
        asyncio.run(check(bad))
    assert "must share a tokenizer" in str(e.value) and "\n" not in str(e.value)
    assert "distill.teacher.tokenizer" in str(e.value)
    asyncio.run(check(same))
    # No local tokenizer and no server to ask: one line saying what to set.
    with pytest.raises(TokenizerMismatch, match="cannot check the tokenizer.*set distill.teacher.tokenizer"):
        asyncio.run(check(bad.model_copy(update={"tokenizer": None})))


@pytest.fixture(scope="module")
def teacher_server(tmp_path_factory):
    pytest.importorskip("prime_inference.server")
    server = TorchServer(build_model(tmp_path_factory.mktemp("teacher") / "model", seed=1))
    yield server
    server.stop()


def teacher_of(server) -> tuple[str, str]:
    return server.url, server.config.model.name


def teacher_logprobs(model_dir, token_ids: list[int]) -> np.ndarray:
    """By hand: log-softmax of the teacher's logits at t - 1, at token t (position 0 has none)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].double()
    lps = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    return np.concatenate([[0.0], lps.numpy()])


@pytest.mark.integration
def test_opd_signal_is_the_reverse_kl_to_the_teacher(tmp_path, tiny_model, torch_server, teacher_server):
    """One step of pure distillation on reverse-text: every sampled token's advantage equals log p_teacher - log
    p_student, with log p_teacher computed here from the teacher's weights and log p_student the sampling log-prob."""
    env = {
        "id": "reverse-text",
        "args": {"num_examples": 50},
        "distill": distill(*teacher_of(teacher_server)).model_dump(),
    }
    config = make_config(tmp_path, tiny_model, torch_server, env=[env], num_trainer_ranks=1)
    config.filters.zero_advantage_groups = True  # a distilling env's groups are never filtered
    run(config)
    teacher_dir = teacher_server.config.model.name
    _, mbs = read_microbatches(tmp_path / "rollouts" / "step_0" / "rank_0.safetensors")
    checked = kls = 0
    for mb in mbs:
        for row in range(mb.input_ids.shape[0]):
            for sid in set(mb.sample_ids[row].tolist()) - {-1}:
                span = mb.sample_ids[row] == sid
                ids, mask = mb.input_ids[row][span].tolist(), mb.loss_mask[row][span]
                want = teacher_logprobs(teacher_dir, ids) - mb.inference_logprobs[row][span]
                got = mb.advantages[row][span]
                assert got[mask] == pytest.approx(want[mask], abs=2e-4)
                assert not got[~mask].any()
                checked += int(mask.sum())
                kls += float(-want[mask].sum())
    assert checked > 20
    from prime_core.monitor import read_metrics

    m = read_metrics(tmp_path / "metrics.jsonl", "orchestrator")[0].values
    assert m["distill/reverse-text/reverse_kl"] == pytest.approx(kls / checked, rel=1e-3)
    assert m["filtered/groups"] == 0 and m["time/teacher_scoring"] > 0


@pytest.mark.integration
def test_teacher_server_tokenizer_is_checked(tmp_path, teacher_server):
    student = build_model(tmp_path / "student")  # the teacher's tokenizer: same corpus
    other = tmp_path / "other"
    build_chatml_tokenizer(["completely different words here", "zebra yak quokka"] * 20, 300).save_pretrained(other)
    teacher = TeacherConfig(base_url=teacher_server.url, model=teacher_server.config.model.name)

    async def check(student_dir):
        async with httpx.AsyncClient() as client:
            await check_tokenizer(str(student_dir), teacher, client)

    asyncio.run(check(student))
    with pytest.raises(TokenizerMismatch, match="must share a tokenizer"):
        asyncio.run(check(other))
    assert CORPUS  # the student and teacher tokenizers are both trained on it


@pytest.mark.integration
def test_privileged_prompt_conditions_the_teacher_only(tmp_path, teacher_server):
    """Self-distillation: the teacher scores the student's tokens after a privileged prompt the student never saw;
    the log-probs returned are those of the student's tokens, read after the prompt."""
    from tokenizers import Tokenizer

    student = build_model(tmp_path / "student")
    prompt = "<|im_start|>system\nthe quick brown fox<|im_end|>\n"
    config = distill(*teacher_of(teacher_server), privileged_prompt=prompt)
    teacher = Teacher("env", config)
    tokenizer = Tokenizer.from_file(str(student / "tokenizer.json"))
    ids = tokenizer.encode("<|im_start|>user\nhello there<|im_end|>\n", add_special_tokens=False).ids

    async def score():
        await teacher.start(str(student))
        try:
            return await teacher.logprobs(ids)
        finally:
            await teacher.client.aclose()

    got = asyncio.run(score())
    prefix = tokenizer.encode(prompt, add_special_tokens=False).ids
    assert teacher.prefix == prefix and len(prefix) > 3
    full = teacher_logprobs(teacher_server.config.model.name, prefix + ids)
    assert got == pytest.approx(full[len(prefix) :].tolist(), abs=2e-4)
    assert got[0] != 0.0  # the first token is now predicted from the prompt


def test_a_teacher_nobody_serves_is_named():
    from prime_orchestrator.distill import TeacherError

    # No base_url: rl fills it from [teacher]; an orchestrator started alone stops at start with one line.
    teachers = Teachers(OrchestratorConfig(env=[{"id": "a"}, {"id": "b", "distill": {}}]))
    with pytest.raises(TeacherError) as e:
        asyncio.run(teachers.start())
    assert str(e.value) == (
        "env 'b': distill.teacher.base_url is unset (rl fills it from [teacher]; a standalone orchestrator needs the "
        "teacher server's)"
    )


def test_teacher_scoring_time_is_the_wall_time_covered_by_concurrent_groups():
    # Three groups scored concurrently over [0, 2] and [1, 3], then one alone over [5, 6]: 4 s of wall time, 5 s summed.
    assert _covered([(1.0, 3.0), (0.0, 2.0), (5.0, 6.0), (1.5, 2.5)]) == pytest.approx(4.0)
    assert _covered([]) == 0.0


def test_distillation_that_trains_nothing_is_a_one_line_config_error(capsys, tmp_path):
    """``kl_weight = 0`` with the default ``reward_weight = 0`` gave every token an advantage of 0: the env ran its
    rollouts and the teacher's scoring, and trained nothing, silently."""
    from prime_core.config import parse_cli

    (tmp_path / "o.toml").write_text('[[env]]\nid = "reverse-text"\n\n[env.distill]\nkl_weight = 0\n')
    with pytest.raises(SystemExit) as exited:
        parse_cli(OrchestratorConfig, ["@", str(tmp_path / "o.toml")], prog="orchestrator")
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        f"error: file {tmp_path}/o.toml: env.0.distill: kl_weight and reward_weight are both 0: every token's advantage "
        "would be 0 (remove distill for RL on the env's reward)\n"
    )
    assert DistillConfig(kl_weight=0, reward_weight=1).kl_weight == 0  # the reward alone still trains
