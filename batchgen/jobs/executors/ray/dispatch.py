"""The driver's side of the kept-warm engines: create or find them, hand them batches, take back their outputs.

    pool = EnginePool(ray, config, resources, n)        # warm engines found, missing ones created
    for out in pool.generate(job_ref, batches, check):  # outputs in the order they finish
        ...
    pool.close()                                        # kills them unless they are kept warm

A batch is whatever the engine's `generate` takes with a `num_rows`: references to Ray Data's blocks
(batchgen.jobs.executors.ray.block_refs.BlockSlices, so input rows go from the object store to the engine, not
through the driver), or a pyarrow.Table (tests, and a Ray Data without block references).

Batches go to engines that have answered `ready` (model loaded) first, at most PER_ENGINE at a time
each (one generating, one queued: no engine takes a backlog another could have started), to the
engine with the fewest in flight. An engine that dies (a lost node, an OOM kill, a kept-warm engine
that ended itself just as the job began) is made again and its batches go out again: nothing the
driver has not received is committed, so a batch generated twice is committed once. After
MAX_DEATHS_PER_ENGINE deaths per engine the job fails with Ray's error.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen.config.job import JobConfig
from batchgen.jobs.executors.ray.engines import NAMESPACE, EngineActor, engine_key, engine_name

log = logging.getLogger("batchgen")

PER_ENGINE = 2
MAX_DEATHS_PER_ENGINE = 2
POLL_S = 0.5  # how often `check` (the job's signal check) runs while every engine is busy


@dataclass(slots=True)
class _Slot:
    handle: Any
    epoch: int = 0  # bumped when the engine is made again: a stale death is not counted twice
    ready: bool = False
    in_flight: int = 0


class EnginePool:
    def __init__(self, ray, config: JobConfig, resources: dict[str, Any], num_engines: int,
                 actor_class: type = EngineActor):
        self.ray = ray
        self.config = config
        self.keep_warm_s = config.ray_keep_warm_s
        self.actor_class = ray.remote(actor_class)
        # no restarts by Ray: a dead engine's batches are this pool's to send again (see _died)
        self.options = {**resources, "max_restarts": 0}
        self.key = engine_key(config, resources)
        self.slots = [_Slot(self._make(i)) for i in range(num_engines)]
        self.deaths = 0

    def _make(self, index: int):
        if not self.keep_warm_s:
            return self.actor_class.options(**self.options).remote(self.config, None)
        # get_if_exists: a warm engine of the same key answers; else this one is created, and stays
        return self.actor_class.options(**self.options, name=engine_name(self.key, index), namespace=NAMESPACE,
                                        lifetime="detached", get_if_exists=True).remote(self.config, self.keep_warm_s)

    def generate(self, job_ref, batches: Iterator[Any], check: Callable[[], None]) -> Iterator[pa.Table]:
        ray = self.ray
        waiting = {slot.handle.ready.remote(): (i, slot.epoch) for i, slot in enumerate(self.slots)}
        running: dict[Any, tuple[int, int, Any]] = {}
        # batches to send before new ones: those of engines that died, and the first one, taken now
        # so that Ray Data starts reading while the engines load their models
        again: collections.deque[Any] = collections.deque()
        first = next(batches, None)
        exhausted = first is None
        if first is not None:
            again.append(first)
        while True:
            while True:  # fill the ready engines
                free = [i for i, s in enumerate(self.slots) if s.ready and s.in_flight < PER_ENGINE]
                if not free or (exhausted and not again):
                    break
                if again:
                    batch = again.popleft()
                else:
                    batch = next(batches, None)
                    if batch is None:
                        exhausted = True
                        continue
                if batch.num_rows == 0:
                    continue
                i = min(free, key=lambda j: self.slots[j].in_flight)
                slot = self.slots[i]
                running[slot.handle.generate.remote(job_ref, batch)] = (i, slot.epoch, batch)
                slot.in_flight += 1
            if not running and not waiting and exhausted and not again:
                return
            done, _ = ray.wait([*running, *waiting], num_returns=1, timeout=POLL_S)
            check()
            for ref in done:
                if ref in waiting:
                    i, epoch = waiting.pop(ref)
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayActorError as e:
                        waiting.update(self._died(i, epoch, e))
                        continue
                    if epoch == self.slots[i].epoch:
                        self.slots[i].ready = True
                    continue
                i, epoch, batch = running.pop(ref)
                if epoch == self.slots[i].epoch:
                    self.slots[i].in_flight -= 1
                try:
                    out = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    again.append(batch)
                    waiting.update(self._died(i, epoch, e))
                    continue
                yield out

    def _died(self, index: int, epoch: int, error: Exception) -> dict[Any, tuple[int, int]]:
        """Engine `index` died (seen from a call of `epoch`): make it again, unless that was done already.
        An engine whose __init__ raised (a model that does not load) fails the job: it would again."""
        slot = self.slots[index]
        if epoch != slot.epoch:
            return {}
        self.deaths += 1
        if getattr(error, "actor_init_failed", False) or self.deaths > MAX_DEATHS_PER_ENGINE * len(self.slots):
            raise error
        log.warning("ray: engine %d died; making it again", index)
        slot.epoch += 1
        slot.ready = False
        slot.in_flight = 0
        slot.handle = self._make(index)
        return {slot.handle.ready.remote(): (index, slot.epoch)}

    def close(self) -> None:
        """Kill the engines unless they are kept warm (they then end themselves when idle)."""
        if self.keep_warm_s:
            return
        for slot in self.slots:
            try:
                self.ray.kill(slot.handle)
            except Exception:  # already gone
                pass
