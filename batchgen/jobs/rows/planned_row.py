"""One input row made ready for the engine: its prompt ids, its budget, and the settings of its own.

Apart from the planner so that every way a row is prepared (plain rows, chat messages, OpenAI Batch
requests) builds the same record without importing the planner that orders them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from batchgen.config.constraint import Constraint
from batchgen.config.job import JobConfig
from batchgen.jobs.rows.prompt_hash import prompt_hash
from batchgen.jobs.rows.rows import InputRow

INPUTS_END = 0xFFFFFFFF  # ends each of a row's encode_inputs in its prompt hash (uint32: never a token id)


@dataclass(frozen=True, slots=True)
class LengthPrediction:
    """A row's predicted output length (batchgen.jobs.planning.length makes it): here, with the record
    that carries it, so that every floor reading a planned row reads it without the predictor."""

    p50: int  # median output tokens: the sort key and the error's reference
    p90: int  # the static policy's reservation
    source: str  # exact | bin | global | prior


@dataclass(slots=True)
class PlannedRow:
    row: InputRow
    prompt_token_ids: list[int]
    max_new_tokens: int
    num_truncated_tokens: int = 0
    known_output_tokens: int | None = None  # from --length-column
    prediction: LengthPrediction | None = None
    window_index: int | None = None  # the WindowPlan it was planned in (the metrics' "window" column)
    sampling: dict[str, Any] | None = None  # the row's own sampling settings (--sampling-column)
    seed: int | None = None  # the row's own seed (a Batch API request's); None = derived from the job's
    stop: tuple[str, ...] | None = None  # the row's own stop strings (a Batch API request's); None = the job's
    logprobs: int | None = None  # the row's own logprobs count (a Batch API request's); None = the job's
    # the row's own structured-output constraint (--json-schema-column, a Batch API response_format); None = the job's
    constraint: Constraint | None = None
    # the row's own settings as canonical JSON (a Batch API request's, or row_settings_key's): part of
    # its prompt hash, so that a resume under the same id regenerates a row whose settings changed, as
    # one whose prompt did
    settings_key: str | None = None
    # the sequences the engine runs for it: its n samples (num_samples), which share the prompt's blocks
    num_samples: int = 1
    # prefix groups (planning/prefix_groups.py): prompt tokens of full blocks another row of its look-ahead
    # holds too; the group it runs with; the row whose blocks it starts from; the look-ahead whose
    # common prefix it shares (None: none); the engine request id it was given (JobCore)
    num_shared_prefix_tokens: int = 0
    prefix_group: int | None = None
    prefix_leader: PlannedRow | None = None
    num_leader_prefix_tokens: int = 0  # of its prompt, the leader's blocks it starts from (assign_leaders)
    common_prefix_lookahead: int | None = None
    request_id: str | None = None
    repeats_prompt: bool = False  # its prompt and own settings are another row's of its look-ahead
    served_from_duplicate: bool = False  # --dedup wrote it from another row's run (JobCore): it ran nothing
    adapter: str | None = None  # the --lora adapter it runs with (jobs/rows/row_adapter.py); None = base
    # embed / score / classify (batchgen.jobs.encoding.encode_core): an OpenAI embeddings line's several
    # inputs, each its own token ids and output row (None: the one input, prompt_token_ids); the row's own
    # Matryoshka cut (None: the job's); the first token whose logprob a score counts (None: every one after the first)
    encode_inputs: list[list[int]] | None = None
    dimensions: int | None = None
    score_from: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_hash(self) -> str:
        if self.encode_inputs is None:
            return prompt_hash(self.prompt_token_ids, self.settings_key)
        # every input, each ended by an id no tokenizer has: ["ab", "c"] and ["a", "bc"] differ
        return prompt_hash([t for ids in self.encode_inputs for t in (*ids, INPUTS_END)], self.settings_key)



def num_samples(config: JobConfig, planned: PlannedRow) -> int:
    """The samples a row asks for: its own n (a sampling cell, a Batch API request), else --n."""
    return (planned.sampling or {}).get("n", config.n)


def row_settings_key(config: JobConfig, max_new_tokens: int, sampling: dict[str, Any] | None,
                     constraint: Constraint | None = None, adapter: dict[str, str] | None = None) -> str | None:
    """The row's own settings (--max-new-tokens-column, --sampling-column) where they differ from
    the job's, as canonical JSON; None for a row run on the job's settings alone.

    Part of the row's prompt hash: under --id-column a committed row whose own settings changed is
    generated again, as one whose prompt changed, and a partial made under other settings is not
    continued (batchgen.jobs.durability.inflight). The job's settings are in the fingerprint already, so a
    row on them keeps the hash of its tokens alone (the hash rows committed before this had)."""
    own: dict[str, Any] = {}
    if max_new_tokens != config.max_new_tokens:
        own["max_new_tokens"] = max_new_tokens
    changed = {key: value for key, value in (sampling or {}).items() if value != getattr(config, key)}
    if changed:
        own["sampling"] = changed
    if constraint is not None:  # a per-row schema: an edited schema regenerates the row
        own["constraint"] = constraint.describe()
    if adapter is not None:  # its name and content hash (row_adapter.adapter_identity): a changed adapter regenerates
        own["adapter"] = adapter
    return json.dumps(own, sort_keys=True) if own else None
