"""The server's version ledger alone (``prime_inference.versions``): what it keeps of rollouts that ended."""

from __future__ import annotations

from prime_core.schemas.rollout import RolloutVersionsRequest
from prime_inference.engines.base import EngineOutput
from prime_inference.versions import VersionLedger


def test_a_record_made_after_its_rollout_was_released_does_not_live_on():
    """The orchestrator pops a failed rollout's record as it fails (``VersionRecords.forget``); a request of that
    rollout still generating (or still on its way) recorded it again, and nothing popped it twice: it stayed until the
    cap of 65,536 records pushed it out. A popped tag now records nothing more."""
    ledger = VersionLedger()
    for i in range(1000):  # 1,000 failed rollouts, each popped while a request of it still runs
        tag = f"failed-{i}"
        ledger.begin(tag, 0)
        ledger.query(RolloutVersionsRequest(tags=[tag], pop=True))
        ledger.record(tag, EngineOutput(token_ids=[5, 6], weight_step=1))  # its running request's next tokens
        ledger.begin(f"late-{i}", 1)  # another's request that reached the server after the pop
        ledger.query(RolloutVersionsRequest(tags=[f"late-{i}"], pop=True))
        ledger.begin(f"late-{i}", 1)
    assert len(ledger.records) == 0, f"{len(ledger.records)} records of released rollouts left"
    ledger.begin("running", 0)  # one not released records as before
    ledger.record("running", EngineOutput(token_ids=[5], weight_step=2))
    assert ledger.query(RolloutVersionsRequest(tags=["running"])).versions["running"].last == 2


def test_the_released_tags_it_remembers_are_bounded():
    ledger = VersionLedger(max_released=100)
    for i in range(1000):
        ledger.query(RolloutVersionsRequest(tags=[f"r-{i}", f"s-{i}"], pop=True))
    assert len(ledger.released) == 100 and "s-999" in ledger.released and "r-0" not in ledger.released
