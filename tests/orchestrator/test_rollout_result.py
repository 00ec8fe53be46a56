"""What a verifiers episode trains: every trainable branch of every trainable trace, with the rollout's reward."""

from __future__ import annotations

import verifiers.v1 as vf
from prime_orchestrator.traces import to_result
from verifiers.v1.configs.agent import AgentConfig
from verifiers.v1.episode import Episode
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import AgentInfo, Reward, Trace, TraceTask
from verifiers.v1.types import AssistantMessage, UserMessage

TASK = TraceTask(type="Task", data=vf.TaskData(prompt="a"))


def node(parent: int | None, ids: list[int], sampled: bool = False) -> MessageNode:
    message = AssistantMessage(content="reply") if sampled else UserMessage(content="prompt")
    lps = [-0.5] * len(ids) if sampled else []
    return MessageNode(
        message=message, parent=parent, sampled=sampled, token_ids=ids, mask=[sampled] * len(ids), logprobs=lps
    )


def trace(nodes: list[MessageNode], reward: float, trainable: bool = True, name: str = "agent") -> Trace:
    agent = AgentInfo(config=AgentConfig(), trainable=trainable, name=name)
    return Trace(task=TASK, agent=agent, nodes=nodes, rewards={"score": Reward(score=reward)})


def test_a_turn_that_does_not_extend_the_history_starts_a_second_trained_sequence():
    # turn 1: [1 2 | 3 4]; turn 2 was re-rendered (3 4 not a prefix): [1 2 5 | 6]
    nodes = [node(None, [1, 2]), node(0, [3, 4], True), node(None, [1, 2, 5]), node(2, [6], True)]
    result = to_result(Episode(task=TASK, ok=True, traces=[trace(nodes, 1.0)]), "env", 0, 1.0)
    assert [s.token_ids for s in result.sequences] == [[1, 2, 3, 4], [1, 2, 5, 6]]
    assert [s.loss_mask for s in result.sequences] == [[False, False, True, True], [False, False, False, True]]
    assert result.sequences[1].logprobs == [0.0, 0.0, 0.0, -0.5]
    assert (result.completion_len, result.prompt_len, result.num_turns, result.reward) == (3, 2, 2, 1.0)


def test_untrainable_seats_train_nothing_and_do_not_score():
    user = trace([node(None, [7]), node(0, [8, 9], True)], 0.0, trainable=False, name="user")
    agent = trace([node(None, [1]), node(0, [2], True)], 0.75)
    result = to_result(Episode(task=TASK, ok=True, traces=[user, agent]), "env", 3, 1.0)
    assert [s.token_ids for s in result.sequences] == [[1, 2]]
    assert result.reward == 0.75 and result.num_turns == 1 and result.metrics == {"reward/score": 0.75}


def test_an_episode_without_a_trainable_seat_is_scored_over_all_seats_and_trains_nothing():
    pair = [trace([node(None, [1]), node(0, [2], True)], r, trainable=False) for r in (1.0, 0.0)]
    result = to_result(Episode(task=TASK, ok=True, traces=pair), "env", 0, 1.0)
    assert result.reward == 0.5 and result.sequences == []


def test_an_episode_the_env_did_not_mark_ok_is_a_failed_rollout_even_without_an_error():
    # "success is the ok stamp": an episode verifiers left not ok trains nothing, whether or not it kept an error.
    result = to_result(Episode(task=TASK, traces=[trace([node(None, [1]), node(0, [2], True)], 1.0)]), "env", 2, 1.0)
    assert result.failed and not result.sequences and result.error == "the env marked the episode not ok (no error)"


def test_an_episode_with_no_trace_is_a_failed_rollout():
    result = to_result(Episode(task=TASK, ok=True, traces=[]), "env", 5, 1.0)
    assert result.failed and not result.sequences and "no trace" in result.error


def test_each_seat_of_a_two_player_episode_carries_its_own_reward_and_metrics():
    first = trace([node(None, [1]), node(0, [2, 3], True)], 1.0, name="first")
    second = trace([node(None, [4]), node(0, [5], True)], -1.0, name="second")
    first.metrics["moves"], second.metrics["moves"] = 1.0, 3.0
    result = to_result(Episode(task=TASK, ok=True, traces=[first, second]), "duel", 0, 1.0)
    assert [(t.seat, t.reward, t.completion_len) for t in result.traces] == [("first", 1.0, 2), ("second", -1.0, 1)]
    assert result.seats == ["first", "second"] and result.reward == 0.0
    assert result.metrics == {"first/moves": 1.0, "first/reward/score": 1.0, "second/moves": 3.0,
                              "second/reward/score": -1.0}  # fmt: skip


def test_attempts_of_one_seat_are_separate_traces_and_metrics_average_over_them():
    attempts = [trace([node(None, [1]), node(0, [2], True)], r) for r in (1.0, 0.0, 0.5)]
    result = to_result(Episode(task=TASK, ok=True, traces=attempts), "best-of", 0, 1.0)
    assert [t.reward for t in result.traces] == [1.0, 0.0, 0.5] and result.seats == ["agent"]
    assert result.metrics == {"reward/score": 0.5} and len(result.sequences) == 3


def test_a_sampled_node_shared_by_two_branches_trains_only_in_the_first():
    # prompt -> sampled reply (shared) -> two continuations, each a leaf: two branches through node 1
    nodes = [node(None, [1]), node(0, [2, 3], True), node(1, [4]), node(2, [5], True), node(1, [6]), node(4, [7], True)]
    result = to_result(Episode(task=TASK, ok=True, traces=[trace(nodes, 1.0)]), "env", 0, 1.0)
    first, second = result.sequences
    assert first.token_ids == [1, 2, 3, 4, 5] and first.loss_mask == [False, True, True, False, True]
    assert second.token_ids == [1, 2, 3, 6, 7] and second.loss_mask == [False, False, False, False, True]
    assert second.logprobs == [0.0, 0.0, 0.0, 0.0, -0.5] and result.completion_len == 4


def test_a_seat_the_env_never_asked_keeps_the_reward_verifiers_gave_it():
    """A two-seat card game where player 0 forfeits before player 1 acts: player 1's trace has no turn (no branch)
    and a reward, which vf-eval reports. It was dropped: the row showed player 0 alone (reward -1, not the seats'
    mean 0), its metrics unprefixed, and player 1's seat baseline missed it."""
    from prime_orchestrator.sample_checks import check_sequences

    task = TraceTask(type="Task", data=vf.TaskData(prompt="a"))
    asked = [
        MessageNode(message=UserMessage(content="p"), parent=None, sampled=False, token_ids=[1], mask=[False]),
        MessageNode(message=AssistantMessage(content="r"), parent=0, sampled=True, token_ids=[2], mask=[True],
                    logprobs=[-0.5]),
    ]  # fmt: skip

    def seat(name: str, nodes: list, payoff: float) -> Trace:
        agent = AgentInfo(config=AgentConfig(), trainable=True, name=name)
        return Trace(task=task, agent=agent, nodes=nodes, rewards={"payoff": Reward(score=payoff)})

    result = to_result(Episode(task=task, ok=True, traces=[seat("p0", asked, -1.0), seat("p1", [], 1.0)]), "k", 0, 1.0)
    assert [(t.seat, t.reward, t.num_turns) for t in result.traces] == [("p0", -1.0, 1), ("p1", 1.0, 0)]
    assert result.reward == 0.0 and result.metrics == {"p0/reward/payoff": -1.0, "p1/reward/payoff": 1.0}
    assert [s.token_ids for s in result.sequences] == [[1, 2]] and result.prompt_len == 1
    # It trains nothing, so it is no server's empty completion (which fails the rollout): nobody asked the server.
    assert [t.trainable for t in result.traces] == [True, False]
    assert check_sequences(result, vocab=8) is None
