"""``prime-chat`` (verifiers' ``null`` chat loop run in the env server) against a policy, as verifiers' own chat
program plays the same episodes (what ``vf-eval`` shows is what trains):

- replies that fill the model's context in a multi-turn episode: verifiers' program ends its run on the overflow (a
  budget limit, not a crash) and the episode is scored on its turns so far. prime-chat's tool-less turn failed the
  rollout instead: the turns that filled the context trained nothing (rambling was never penalised) and enough such
  rollouts stopped the run (``recovery.min_ok_fraction``);
- a reply that calls a tool in an episode without tools: verifiers' program answers ``error: unknown tool`` and asks
  the model again; prime-chat ended the turn on the tool call and scored that reply.
"""

from __future__ import annotations

import asyncio
import re

import pytest
from prime_core.config.orchestrator import ClientConfig, EnvConfig, SamplingConfig

from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
from tests.fixtures.scripted import ScriptedServer
from tests.fixtures.vf import use_vf_envs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MAX_MODEL_LEN = 512
FILLER = " and" * 300  # ~300 tokens a reply: the third turn's prompt (~700 tokens) is past the context


def policy(prompt: str) -> str | None:
    """vf-multi-turn asks for a word each turn: echo it, then ramble. vf-single-turn asks to repeat a word: call a
    tool first, answer once told the tool is unknown."""
    if m := re.search(r"Say (\w+)\.<\|im_end\|>\n<\|im_start\|>assistant\n$", prompt):
        return m.group(1) + FILLER
    if m := re.search(r"Repeat the word (\w+)\.", prompt):
        told = "error: unknown tool 'grade'" in prompt.rsplit("<|im_start|>user\n", 1)[-1]
        return f"<answer>{m.group(1)}</answer>" if told else '<tool_call>{"name": "grade", "arguments": {}}</tool_call>'
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("tool_model"), build_tool_tokenizer())
    srv = ScriptedServer(model, policy, max_model_len=MAX_MODEL_LEN)
    yield srv
    srv.stop()


async def _rollout(server, env: EnvConfig):
    from prime_orchestrator.envs import EnvRunner, sampling_args, server_spec, train_client

    runner = EnvRunner(env, server_spec(env), max_retries=0)
    await runner.start()
    try:
        client = train_client(ClientConfig(), server.config.model.name, server.url)
        sampling = sampling_args(SamplingConfig(max_tokens=64, temperature=1.0), seed=0)
        return await runner.rollout(0, client=client, model=server.config.model.name, sampling=sampling)
    finally:
        await runner.close()


def test_a_context_overflow_ends_the_chat_episode_scored_on_its_turns_so_far(server, monkeypatch):
    from transformers import AutoTokenizer

    use_vf_envs(monkeypatch)
    env = EnvConfig.model_validate({"id": "vf-multi-turn", "rollout_timeout": 120})  # auto: prime-chat
    result = asyncio.run(_rollout(server, env))
    assert not result.failed, result.error  # was: "Prompt length (700) exceeds maximum context length (512)."
    # task 0 asks for red, green, blue: two turns echoed before the third prompt overflowed
    assert result.num_turns == 2 and result.reward == pytest.approx(2 / 3)
    (trace,) = result.traces
    (seq,) = trace.sequences
    tokenizer = AutoTokenizer.from_pretrained(server.config.model.name)
    sampled = tokenizer.decode([t for t, m in zip(seq.token_ids, seq.loss_mask, strict=True) if m])
    assert sampled == f"red{FILLER}<|im_end|>green{FILLER}<|im_end|>"  # both turns train, as sampled


def test_a_tool_call_without_tools_is_answered_unknown_and_the_model_asked_again(server, monkeypatch):
    use_vf_envs(monkeypatch)
    env = EnvConfig.model_validate({"id": "vf-single-turn", "harness": "null", "rollout_timeout": 120})  # prime-chat
    result = asyncio.run(_rollout(server, env))
    assert not result.failed, result.error
    # was: one turn, the tool call scored (reward 0)
    assert result.num_turns == 2 and result.reward == 1.0
    assert "[tool] error: unknown tool 'grade'" in result.completion
    (trace,) = result.traces
    assert len(trace.sequences) == 1  # both turns in one sample: the second extends the first


@pytest.mark.parametrize(
    ("status", "text", "overflow"),
    [
        (400, "Prompt length (700) exceeds maximum context length (512).", True),  # renderers' pre-flight
        (400, "This model's maximum context length is 512 tokens. However, you requested 600 tokens", True),
        (413, "prompt is too long: 900 tokens > 512 maximum", True),
        (400, "temperature must be non-negative", False),
        (500, "maximum context length", False),
    ],
)
def test_context_overflow_is_judged_as_verifiers_chat_program_judges_it(status, text, overflow):
    from prime_chat.harness import context_overflow

    assert context_overflow(status, text) is overflow


def test_the_first_messages_are_those_verifiers_chat_program_sends():
    # verifiers' program (harnesses/utils/core.py) opens with the system prompt, then the prompt's messages, or a
    # user message for a non-empty prompt string (`elif args.prompt`); prime-chat sent an empty user message for "".
    from prime_chat.harness import initial_messages
    from verifiers.v1.types import AssistantMessage, UserMessage

    system = {"role": "system", "content": "be brief"}
    assert initial_messages("be brief", "") == [system]
    assert initial_messages("be brief", "hi") == [system, {"role": "user", "content": "hi"}]
    assert initial_messages(None, None) == []
    shots = [UserMessage(content="a?"), AssistantMessage(content="A"), UserMessage(content="b?")]
    assert [(m["role"], m["content"]) for m in initial_messages(None, shots)] == [
        ("user", "a?"),
        ("assistant", "A"),
        ("user", "b?"),
    ]
