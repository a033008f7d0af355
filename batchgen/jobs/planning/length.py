"""Output-length predictor: quantiles of output tokens given prompt tokens, learned as rows finish.

A prediction is two quantiles of the row's output length (generated tokens, a final EOS
included), never a mean: output lengths are heavy-tailed. The planner sorts rows by p50 and the
static policy reserves KV memory for p90 (a row that runs past it is parked and finished later,
never cut short). Sources, most specific first:

  exact   --ignore-eos (every row generates its max_new_tokens) or a --length-column value
  bin     >= MIN_SAMPLES finished rows whose prompt length fell in the same log-spaced bin
  global  >= MIN_SAMPLES finished rows of this job, any prompt length
  prior   nothing learned yet: p50 = half of max_new_tokens, p90 = max_new_tokens

Bins are half-octaves of prompt tokens (1, 2, 3, 4-5, 6-7, 8-11, ...): what a prompt of 40 tokens
yields says little about one of 4000. Each bin keeps a bounded uniform sample (a reservoir) of
the output lengths it saw, so memory stays fixed however long the job runs. Every prediction is
clamped to [1, the row's max_new_tokens]. Observations at the cap ("length") are kept as they are:
a later row with a larger cap may be predicted short, which costs an overrun, not a wrong row.

The learned state is written to `_length_model.json` in the output directory (temp file, fsync,
rename) and read back by a resumed run or the next job on the same directory, but only when it
was learned with the same key (model, template, system prompt, chat template use): lengths learned
for one prompt say little about another's.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.errors import OutputError
from batchgen.io.store.factory import open_store
from batchgen.io.store.store import LocalStore, OutputStore
from batchgen.jobs.planning.stats import Reservoir, spearman
from batchgen.jobs.prompting.prompts import parse_count
from batchgen.jobs.rows.planned_row import LengthPrediction

log = logging.getLogger("batchgen")

LENGTH_MODEL_FILE = "_length_model.json"
FORMAT = "batchgen.length_model"
VERSION = 1
MIN_SAMPLES = 8  # finished rows a bin (or the job) needs before its quantiles replace the prior
BIN_SAMPLES = 64  # reservoir size per prompt-length bin
GLOBAL_SAMPLES = 512  # reservoir size over all rows
ERROR_SAMPLES = 4096  # (predicted, actual) pairs kept for the rank correlation
PRIOR_P50_FRACTION = 0.5


def prompt_bin(num_prompt_tokens: int) -> int:
    """Half-octave bin of a prompt length: 0 for 1 token, 2 for 2, 3 for 3, 4 for 4-5, 5 for 6-7, ..."""
    return int(2 * math.log2(max(1, num_prompt_tokens)))


@dataclass(frozen=True, slots=True)
class LengthError:
    num_rows: int
    mae: float | None  # mean |p50 - actual| over every observed row
    spearman: float | None  # rank correlation of p50 and actual (a bounded sample); None if constant


class LengthPredictor:
    def __init__(self, key: dict[str, Any] | None = None, *, ignore_eos: bool = False, seed: int = 0):
        self.key = dict(key or {})
        self.ignore_eos = ignore_eos
        self.bins: dict[int, Reservoir] = {}
        self.overall = Reservoir(GLOBAL_SAMPLES)
        self.num_observed_since_save = 0
        self._rng = random.Random(seed)
        # this run's error: every |p50 - actual|, and a bounded sample of pairs for the ranks
        self._abs_error_sum = 0
        self._num_errors = 0
        self._pairs = _PairSample(ERROR_SAMPLES, self._rng)

    # ---- predicting ------------------------------------------------------------------------
    def predict(self, num_prompt_tokens: int, max_new_tokens: int, known: int | None = None) -> LengthPrediction:
        def clamp(n: float) -> int:
            return min(max_new_tokens, max(1, int(round(n))))

        if known is not None:
            n = clamp(known)
            return LengthPrediction(n, n, "exact")
        if self.ignore_eos:
            return LengthPrediction(max_new_tokens, max_new_tokens, "exact")
        sample = self.bins.get(prompt_bin(num_prompt_tokens))
        source = "bin"
        if sample is None or len(sample.values) < MIN_SAMPLES:
            sample, source = self.overall, "global"
        if len(sample.values) < MIN_SAMPLES:
            return LengthPrediction(clamp(PRIOR_P50_FRACTION * max_new_tokens), max_new_tokens, "prior")
        return LengthPrediction(clamp(sample.quantile(0.5)), clamp(sample.quantile(0.9)), source)

    # ---- learning --------------------------------------------------------------------------
    def observe(self, num_prompt_tokens: int, num_output_tokens: int,
                prediction: LengthPrediction | None = None) -> None:
        """Learn from a finished row; with its prediction, also count the prediction's error."""
        b = prompt_bin(num_prompt_tokens)
        if b not in self.bins:
            self.bins[b] = Reservoir(BIN_SAMPLES)
        self.bins[b].add(num_output_tokens, self._rng)
        self.overall.add(num_output_tokens, self._rng)
        self.num_observed_since_save += 1
        if prediction is not None:
            self._abs_error_sum += abs(prediction.p50 - num_output_tokens)
            self._num_errors += 1
            self._pairs.add(prediction.p50, num_output_tokens)

    def error(self) -> LengthError:
        n = self._num_errors
        return LengthError(n, self._abs_error_sum / n if n else None, self._pairs.spearman())

    # ---- persistence -----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "key": self.key,
                "bins": {str(b): r.to_json() for b, r in sorted(self.bins.items())},
                "global": self.overall.to_json()}

    def load_state(self, data: dict[str, Any]) -> None:
        self.bins = {int(b): Reservoir.from_json(BIN_SAMPLES, r) for b, r in data["bins"].items()}
        self.overall = Reservoir.from_json(GLOBAL_SAMPLES, data["global"])

    @property
    def num_learned_rows(self) -> int:
        return self.overall.count

    def save(self, out_dir: str | Path | OutputStore) -> bool:
        """Write the learned state atomically; False (and a warning) if it could not be written.

        Best effort on purpose: the file only speeds up the next run's planning, so a full disk
        fails the job at its next commit, not here. It uses its own temp-file write rather than
        batchgen.io.store.writers so that it never counts as, or fails like, a commit.
        """
        store = open_store(out_dir)
        data = (json.dumps(self.to_json(), separators=(",", ":")) + "\n").encode()
        if not isinstance(store, LocalStore):  # an object store: one PUT, whole or absent
            try:
                store.write_bytes(LENGTH_MODEL_FILE, data)
            except OutputError as e:
                log.warning("could not save the output-length model to %s: %s", store / LENGTH_MODEL_FILE, e)
                return False
            self.num_observed_since_save = 0
            return True
        path = store.path(LENGTH_MODEL_FILE)
        temp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"  # recovery deletes stale ones
        try:
            try:
                with open(temp, "xb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(temp, path)
            finally:
                temp.unlink(missing_ok=True)
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("could not save the output-length model to %s: %s", path, e.strerror or e)
            return False
        self.num_observed_since_save = 0
        return True

    @classmethod
    def load(cls, out_dir: str | Path | OutputStore | None, key: dict[str, Any], *,
             ignore_eos: bool = False) -> LengthPredictor:
        """The state saved in `out_dir` if it was learned under the same key, else a fresh predictor."""
        predictor = cls(key, ignore_eos=ignore_eos)
        if out_dir is None:
            return predictor
        store = open_store(out_dir)
        path = store / LENGTH_MODEL_FILE
        try:
            data = json.loads(store.read_bytes(LENGTH_MODEL_FILE).decode("utf-8"))
        except FileNotFoundError:
            return predictor
        except (OSError, ValueError) as e:
            log.warning("ignoring %s: cannot read it (%s)", path, e)
            return predictor
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            log.warning("ignoring %s: not a version-%d batchgen length model", path, VERSION)
            return predictor
        if data.get("key") != predictor.key:
            log.info("output-length model in %s was learned for another model or prompt; starting from the prior",
                     path)
            return predictor
        try:
            predictor.load_state(data)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("ignoring %s: malformed (%s)", path, e)
            return cls(key, ignore_eos=ignore_eos)
        log.info("output-length model: %d finished rows learned by an earlier run", predictor.num_learned_rows)
        return predictor


class _PairSample:
    """A bounded uniform sample of (predicted, actual) pairs, for the rank correlation."""

    def __init__(self, size: int, rng: random.Random):
        self.sample = Reservoir(size)
        self._rng = rng

    def add(self, predicted: int, actual: int) -> None:
        self.sample.add((predicted, actual), self._rng)

    def spearman(self) -> float | None:
        pairs = self.sample.values
        if len(pairs) < 2:
            return None
        return spearman([p for p, _ in pairs], [a for _, a in pairs])


def parse_known_length(value: Any, column: str) -> int | None:
    """A --length-column cell: null = unknown; otherwise a whole number of tokens >= 0.

    A bad cell is a RowError, like a bad --max-new-tokens-column cell: the column is the user's
    claim about the data, and a claim that cannot be read is worth saying so."""
    if value is None:
        return None
    return parse_count(value, column, minimum=0, expected="a whole number of output tokens >= 0 (or null)")
