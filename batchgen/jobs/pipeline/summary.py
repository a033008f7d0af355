"""The end-of-job summary: rows, tokens, throughput, and the engine's iteration-level counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def plural(count: int, noun: str) -> str:
    """'1 commit', '2 commits', '0 commits' (nouns here take a plain -s)."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


@dataclass(slots=True)
class JobSummary:
    output_dir: str
    model: str
    mode: str
    task: str = "generate"  # embed / score / classify: one forward pass per row, no generated tokens
    num_rows: int = 0
    num_rows_ok: int = 0
    num_rows_error: int = 0
    num_rows_truncated: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_parts_written: int = 0
    wall_seconds: float = 0.0
    engine: dict = field(default_factory=dict)
    # the length planner (batchgen.jobs.planning.planner): windows by mode, static reruns of failed continuous runs
    num_windows_static: int = 0
    num_windows_continuous: int = 0
    num_static_fallbacks: int = 0
    num_rows_from_duplicates: int = 0  # rows written from another row's run (--dedup: the same prompt and settings)
    # prompt tokens of the rows generated that another row holds too (jobs/planning/prefix_groups.py),
    # and those their first admission found in the prefix cache
    num_shareable_prefix_tokens: int = 0
    num_prefix_hit_prompt_tokens: int = 0
    # predicted (p50) vs actual output tokens of the rows generated in this run
    num_length_predictions: int = 0
    length_mae: float | None = None
    length_spearman: float | None = None
    length_sources: dict = field(default_factory=dict)  # rows per prediction source (exact, bin, ...)

    @property
    def generated_tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.num_prompt_tokens / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def forward_share(self) -> float | None:
        """The model calls' share of the job's wall time: what is left is host work on the critical
        path (scheduling, input packing, sampling, detokenization, writes, commits)."""
        forward_s = self.engine.get("forward_seconds")
        return None if forward_s is None or not self.wall_seconds else forward_s / self.wall_seconds

    def count_row(self, out: dict) -> bool:
        """Count one finished output row (batch_fn.output_row's columns); True for an error row."""
        # an embed / score / classify row has no finish_reason: its error column says it failed
        is_error = out["finish_reason"] == "error" if "finish_reason" in out else out["error"] is not None
        self.num_rows += 1
        self.num_rows_error += int(is_error)
        self.num_rows_ok += int(not is_error)
        self.num_prompt_tokens += out["num_prompt_tokens"] or 0
        self.num_generated_tokens += out.get("num_generated_tokens") or 0
        return is_error

    def to_dict(self) -> dict:
        d = asdict(self)
        d["generated_tokens_per_s"] = round(self.generated_tokens_per_s, 2)
        d["prompt_tokens_per_s"] = round(self.prompt_tokens_per_s, 2)
        share = self.forward_share
        d["forward_share"] = None if share is None else round(share, 4)
        return d

    def lines(self) -> list[str]:
        e = self.engine
        out = [
            f"done: {plural(self.num_rows, 'row')} ({self.num_rows_ok} ok, {plural(self.num_rows_error, 'error')}, "
            f"{plural(self.num_rows_truncated, 'truncated prompt')}"
            + (f", {self.num_rows_from_duplicates} served from a duplicate prompt" if self.num_rows_from_duplicates
               else "") + f") in {self.wall_seconds:.1f}s",
            f"tokens: {self.num_prompt_tokens} prompt, {self.num_generated_tokens} generated, "
            f"{self.generated_tokens_per_s:.1f} generated tok/s ({self.model}, {self.mode})",
        ]
        if self.task != "generate":  # one forward pass per row: the prompt tokens are the work
            rows_per_s = self.num_rows / self.wall_seconds if self.wall_seconds else 0.0
            out[1] = (f"tokens: {self.num_prompt_tokens} prompt, {self.prompt_tokens_per_s:.1f} prompt tok/s, "
                      f"{rows_per_s:.1f} rows/s ({self.model}, {self.task})")
            if e.get("num_batches"):
                waste = "n/a" if e.get("padding_waste") is None else f"{e['padding_waste']:.3f}"
                out.insert(2, f"encoder: {e['num_batches']} batches, tokens run / needed {waste}")
        if e.get("num_steps"):
            out.append(
                f"engine: {e['num_steps']} steps, step p50 {e['step_ms_p50']} ms / p99 {e['step_ms_p99']} ms, "
                f"{e['running_mean']} running on average (max {e['running_max']}), "
                f"KV blocks used max {e['kv_blocks_used_max']}/{e['kv_blocks_total']}, "
                f"{e['num_preemptions']} preemptions, {e['num_prefix_hit_tokens']} prefix-cache hit tokens"
                + (f", {e['num_forced_tokens']} forced tokens (decode steps saved by --jump-forward)"
                   if e.get("num_forced_tokens") else "")
                + ("" if self.forward_share is None else f"; the model's forward {100 * self.forward_share:.1f}% "
                                                          "of the job's wall time"))
        if self.num_shareable_prefix_tokens:
            share = self.num_prefix_hit_prompt_tokens / self.num_shareable_prefix_tokens
            out.append(f"prefix: {self.num_prefix_hit_prompt_tokens} of {self.num_shareable_prefix_tokens} shareable "
                       f"prompt tokens came from the prefix cache ({100 * share:.0f}%)")
        if self.num_windows_static or self.num_windows_continuous:
            mae = "n/a" if self.length_mae is None else f"{self.length_mae:.1f}"
            rho = "n/a" if self.length_spearman is None else f"{self.length_spearman:.2f}"
            sources = ", ".join(f"{k} {v}" for k, v in sorted(self.length_sources.items())) or "none"
            out.append(f"plan: {self.num_windows_static} static and {self.num_windows_continuous} continuous "
                       f"{'window' if self.num_windows_static + self.num_windows_continuous == 1 else 'windows'}, "
                       f"{plural(self.num_static_fallbacks, 'static fallback')}; output length predicted (p50) "
                       f"vs actual: MAE {mae} tokens, Spearman {rho} over "
                       f"{plural(self.num_length_predictions, 'row')} ({sources})")
        out.append(f"output: {self.output_dir}")
        return out


@dataclass(slots=True)
class RunSummary(JobSummary):
    """JobSummary plus what this run found already committed and what it committed."""

    num_rows_skipped: int = 0  # committed by an earlier run (or an error row kept: --no-retry-errors)
    num_rows_retried: int = 0  # error rows of an earlier run generated again
    num_rows_replaced: int = 0  # ... whose new row replaced the old one (the rest failed the same way)
    num_rows_changed: int = 0  # committed rows (--id-column) whose prompt changed: generated again, replaced
    num_commits: int = 0
    num_sampled_tokens: int = 0  # tokens this run's engine sampled, rows still in flight included
    num_rows_continued: int = 0  # rows continued from an earlier attempt's in-flight checkpoint
    num_tokens_continued: int = 0  # ... the tokens that attempt had generated (not generated again)
    first_token_time: float | None = None  # unix time of this run's first sampled token (restart latency)
    num_inflight_checkpoints: int = 0  # in-flight checkpoints this run wrote (signal, timer)
    inflight_checkpoint_seconds: float = 0.0  # time spent writing them
    partial: bool = False  # written by a run that stopped early (a signal, an error): counts so far
    output_rows: int = 0  # committed rows in the output directory after this run
    output_rows_error: int = 0
    complete: bool = False  # every input row has a committed output row (_SUCCESS written)
    nothing_to_do: bool = False  # every input row was committed before this run: no model was loaded
    empty_input: bool = False  # the input held no rows: no model was loaded, the job is complete as it is
    executor: str = "local"  # local (this process) or ray (batchgen.jobs.executors.ray)
    num_actors: int = 0  # ray: the actor pool's size (models loaded)

    def lines(self) -> list[str]:
        if self.empty_input:
            return [f"nothing to do: the input holds no rows; no model was loaded"
                    f"{'' if self.complete else ', incomplete'}", f"output: {self.output_dir}"]
        if self.nothing_to_do:
            return [f"nothing to do: all {self.num_rows_skipped} rows are committed "
                    f"({plural(self.output_rows_error, 'error row')}); no model was loaded",
                    f"output: {self.output_dir}"]
        out = JobSummary.lines(self)
        out.insert(-1, f"resume: {plural(self.num_rows_skipped, 'row')} already committed, "
                       f"{plural(self.num_rows_continued, 'row')} continued from in-flight checkpoints "
                       f"({plural(self.num_tokens_continued, 'token')} they held, not generated again), "
                       f"{plural(self.num_rows_retried, 'error row')} retried, "
                       f"{plural(self.num_rows_changed, 'changed prompt')} ({self.num_rows_replaced} replaced); "
                       f"{plural(self.num_commits, 'commit')}; output holds {plural(self.output_rows, 'row')} "
                       f"({plural(self.output_rows_error, 'error')})"
                       f"{'' if self.complete else ', incomplete'}")
        return out
