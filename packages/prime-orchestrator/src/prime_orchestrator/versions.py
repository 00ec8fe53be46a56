"""The policy versions each rollout spans, read from the inference servers' version ledgers.

Every rollout's requests carry a tag (``ROLLOUT_TAG`` in ``sampling_params.extra_args``: verifiers' train client
passes sampling fields it does not know through to ``/inference/v1/generate``). The server records, per tag, the
weight step of the first and last sampled token (`prime_inference.versions`); this module reads those records
(``POST /rollout_versions``): ``take`` when a rollout ends (requests of rollouts that end together share one call
per server), ``peek`` while it runs, ``abort`` to stop a stale one. A server without the route (another server, an
older prime) answers 404: the rollout then gets bounds from the weight relay's timeline instead (the version served
when its first request went out, and when it ended), marked ``exact = False``, and a warning says so once.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from prime_core.config.orchestrator import ClientConfig
from prime_core.run_dir import RunDir
from prime_core.schemas.rollout import PolicyVersions, RolloutVersionsRequest, RolloutVersionsResponse

from prime_orchestrator.client import WeightUpdateError, headers

logger = logging.getLogger("prime.orchestrator.versions")
TIMEOUT_S = 30.0


@dataclass
class Flight:
    """One rollout's requests: its tag, the server they go to, and the served version when the first went out."""

    tag: str = ""
    url: str = ""
    started: int | None = None
    """``Policy.version`` when the rollout got its concurrency slot (None: still waiting, nothing sampled)."""
    seed: int | None = None
    """Its sampling seed (None: the step-synchronous seed of its step and index)."""
    versions: PolicyVersions | None = None
    """Once it finished: the versions it spans."""


class ServerWentBack(WeightUpdateError):
    """A server sampled with weights older than those the relay had loaded into it before the request went out."""


def check_served(flight: Flight, record: PolicyVersions | None) -> None:
    """Raise `ServerWentBack` when ``record`` (the server's, of ``flight``) holds a token older than the version
    served when the rollout started. The relay raises the version only once every server answered the update, so a
    server can only be behind it after a restart (back to its base weights) or a reload: the relay would take it as
    current and never load it again (it loads only newer steps), and in continuous mode every group it serves is
    stale, dropped and redrawn while the run ships nothing, silently and without end."""
    if record is None or flight.started is None or record.first >= flight.started:
        return
    raise ServerWentBack(
        f"inference server {flight.url} sampled with weights step {record.first} after it had loaded step "
        f"{flight.started} (it restarted or reloaded its weights); its rollouts' versions cannot be vouched for"
    )


class Published:
    """The newest weight step the trainer published in ``run_dir`` (0: the base weights), re-read from the
    directory only when asked about a newer step than the newest seen."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        self.newest = 0

    def covers(self, step: int) -> bool:
        if step > self.newest:
            self.newest = max(self.newest, self.run_dir.latest_stable_weight_step() or 0)
        return step <= self.newest


def check_published(url: str, tag: str, record: PolicyVersions | None, published: Published | None = None) -> None:
    """Raise `ServerWentBack` when ``record`` (of rollout ``tag``, from ``url``) names a last token older than the
    first, a negative count, or a weight step newer than any the trainer published (``published``, the run
    directory's weights): the server's ledger is broken or not this run's, and every rollout counted from it
    (staleness, the continuous scheduler's bound) would be wrong.
    The relay's own newest step is no bound: a server started on resumed weights, or updated by another hand (an
    operator), serves steps the relay never sent, but none the trainer never wrote."""
    if record is None:
        return
    if record.first > record.last or record.num_tokens < 0:
        problem = f"steps {record.first}..{record.last} over {record.num_tokens} tokens"
    elif published is not None and not published.covers(record.last):
        newest = published.newest
        problem = f"weight step {record.last}, newer than any the trainer published (newest: step {newest})"
    else:
        return
    raise ServerWentBack(f"inference server {url}: the version record of rollout {tag} names {problem}")


class NoVersionRecord(WeightUpdateError):
    """``dispatch_ahead`` against a server that keeps no version record: nothing vouches that it held the requests."""


class VersionRecords:
    def __init__(
        self, client: ClientConfig, check: bool = True, held: bool = False, run_dir: RunDir | None = None
    ) -> None:
        self.client = client
        self.published = Published(run_dir) if run_dir is not None else None
        """Records naming a weight step the trainer never wrote to ``run_dir`` are refused (`check_published`)."""
        self.check = check
        self.held = held
        """Requests ask the server to hold them for their weights (``dispatch_ahead``): only a server's record says
        it did. One without the route (plain vLLM) ignores the field and samples at once with older weights, and the
        relay's bounds would count those tokens as sampled with the weights the request asked for."""
        """`check_served` on every record read. Off for LoRA runs: vLLM's records of adapter requests carry the base
        weights' step (0), not the adapter's; a restarted server has no adapter and fails their requests anyway."""
        self.prefix = uuid.uuid4().hex[:12]
        self.count = 0
        self.unsupported: set[str] = set()
        self.warned_missing = False
        self._http: httpx.AsyncClient | None = None
        self._waiting: dict[str, dict[str, asyncio.Future | None]] = {}
        """url -> tag -> the future of its `take`; None for a tag only `forget` pops (nobody waits for it)."""
        self._flush: asyncio.Task | None = None

    def new_tag(self) -> str:
        self.count += 1
        return f"{self.prefix}-{self.count}"

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(headers=headers(self.client.resolved_api_key()), timeout=TIMEOUT_S)
        return self._http

    async def _post(self, url: str, req: RolloutVersionsRequest) -> RolloutVersionsResponse | None:
        """The server's answer; None where it keeps no record (404) or could not answer (logged)."""
        if url in self.unsupported:
            return None
        try:
            # As a whole: httpx's timeout restarts at every chunk, and a trickled answer held every take behind it.
            async with asyncio.timeout(TIMEOUT_S):
                resp = await self._client().post(url.rstrip("/") + "/rollout_versions", json=req.model_dump())
        except TimeoutError:
            logger.warning("rollout versions from %s: no whole answer in %.0fs; using the weight relay's bounds", url,
                           TIMEOUT_S)  # fmt: skip
            return None
        except httpx.HTTPError as e:
            logger.warning("rollout versions from %s failed (%s); using the weight relay's bounds", url, e)
            return None
        if resp.status_code == 404:
            self.unsupported.add(url)
            logger.warning("inference server %s keeps no version record (no /rollout_versions): rollout versions "
                           "are bounds from the weight relay's timeline", url)  # fmt: skip
            return None
        if resp.status_code != 200:
            logger.warning("rollout versions from %s: %s %s", url, resp.status_code, resp.text[:200])
            return None
        try:
            return RolloutVersionsResponse.model_validate(resp.json())
        except ValueError as e:  # another server's answer: no record (it raised in the flush, whose takes then hung)
            logger.warning("rollout versions from %s: not a version record (%s): %s", url, e, resp.text[:200])
            return None

    async def take(self, flight: Flight) -> PolicyVersions | None:
        """The record of a finished rollout (forgotten by the server once read); `ServerWentBack` when it shows the
        server went back to older weights."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(flight.url, {})[flight.tag] = future
        if self._flush is None:
            self._flush = asyncio.create_task(self._flush_takes())
        record = await future
        if record is None and self.held and flight.url in self.unsupported:
            raise NoVersionRecord(
                f"inference server {flight.url} keeps no version record (no /rollout_versions): dispatch_ahead needs "
                "prime's inference server, which holds each request until the weights it names; set dispatch_ahead "
                "= false for this server"
            )
        check_published(flight.url, flight.tag, record, self.published)
        if self.check:
            check_served(flight, record)
        return record

    def forget(self, flight: Flight) -> None:
        """Pop a failed rollout's record unread, with the next flush. The server keeps a tag's record until it is
        popped (up to its cap of 65536): a failed rollout's, never taken, stayed there, one more per failure."""
        if not (flight.tag and flight.url) or flight.url in self.unsupported:
            return
        self._waiting.setdefault(flight.url, {}).setdefault(flight.tag, None)
        if self._flush is None:
            self._flush = asyncio.create_task(self._flush_takes())

    async def _flush_takes(self) -> None:
        await asyncio.sleep(0)  # rollouts that end together share one call per server
        batch, self._waiting, self._flush = self._waiting, {}, None
        try:
            for url, futures in batch.items():
                answer = await self._post(url, RolloutVersionsRequest(tags=list(futures), pop=True))
                found = answer.versions if answer is not None else {}
                taken = [tag for tag, future in futures.items() if future is not None]
                if answer is not None and any(t not in found for t in taken) and not self.warned_missing:
                    self.warned_missing = True
                    logger.warning("inference server %s has no version record of some finished rollouts (does the "
                                   "client pass sampling_params.extra_args through?); using the weight relay's "
                                   "bounds", url)  # fmt: skip
                for tag, future in futures.items():
                    if future is not None and not future.done():
                        future.set_result(found.get(tag))
        finally:  # whatever ended the flush, no take waits on for an answer that will not come: bounds instead
            for futures in batch.values():
                for future in futures.values():
                    if future is not None and not future.done():
                        future.set_result(None)

    async def peek(self, flights: list[Flight]) -> dict[str, PolicyVersions] | None:
        """Records of running rollouts; None where a server keeps none; `ServerWentBack` as ``take``."""
        found: dict[str, PolicyVersions] = {}
        for url in {f.url for f in flights}:
            answer = await self._post(url, RolloutVersionsRequest(tags=[f.tag for f in flights if f.url == url]))
            if answer is None:
                return None
            found.update(answer.versions)
        for flight in flights:
            check_published(flight.url, flight.tag, found.get(flight.tag), self.published)
        for flight in flights if self.check else ():
            check_served(flight, found.get(flight.tag))
        return found

    async def abort(self, flights: list[Flight]) -> None:
        """Stop the requests of these rollouts still generating, and forget their records."""
        for url in {f.url for f in flights if f.tag}:
            tags = [f.tag for f in flights if f.url == url]
            await self._post(url, RolloutVersionsRequest(tags=tags, pop=True, abort=True))

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()


def bounds(started: int, now: int) -> PolicyVersions:
    """Versions from the weight relay's timeline: the first token is no older than the version served when the
    rollout's first request went out, the last no newer than the one served when it ended."""
    return PolicyVersions(first=started, last=now, exact=False)


def version_metrics(step: int, results: list[Any]) -> dict[str, float]:
    """Staleness (the step minus the version of each rollout's first token, queue time included) and the versions
    each rollout spans, over the step's rollouts that sampled something."""
    versions = [r.versions for r in results if r.versions is not None and not r.failed]
    if not versions:
        return {}
    staleness = np.array([step - v.first for v in versions])
    return {
        "off_policy/max": int(staleness.max()),
        "off_policy/mean": float(staleness.mean()),
        "policy/version_span/max": max(v.last - v.first for v in versions),
        "policy/version_span/mean": float(np.mean([v.last - v.first for v in versions])),
        "policy/versions_exact": float(np.mean([v.exact for v in versions])),
    }
