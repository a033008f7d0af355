"""What the scheduler decides for one step: the sequences that run, the tokens each computes and
whether it samples; read by the model runner and the CUDA graphs. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    samples: bool  # this step brings the sequence level, so it samples its next token


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_preempted: int = 0
    num_overruns: int = 0  # static: sequences parked for running past their reservation
    # finished without running: the KV cache cannot hold even this one sequence's next token
    out_of_memory: list[Sequence] = field(default_factory=list)

    @property
    def samplers(self) -> list[Sequence]:
        return [s.seq for s in self.scheduled if s.samples]
