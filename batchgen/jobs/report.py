"""The end-of-job summary: rows, tokens, throughput, and the engine's iteration-level counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class JobSummary:
    output_dir: str
    model: str
    mode: str
    num_rows: int = 0
    num_rows_ok: int = 0
    num_rows_error: int = 0
    num_rows_truncated: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_parts_written: int = 0
    wall_seconds: float = 0.0
    engine: dict = field(default_factory=dict)

    @property
    def generated_tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.wall_seconds if self.wall_seconds else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["generated_tokens_per_s"] = round(self.generated_tokens_per_s, 2)
        return d

    def lines(self) -> list[str]:
        e = self.engine
        out = [
            f"done: {self.num_rows} rows ({self.num_rows_ok} ok, {self.num_rows_error} errors, "
            f"{self.num_rows_truncated} truncated prompts) in {self.wall_seconds:.1f}s",
            f"tokens: {self.num_prompt_tokens} prompt, {self.num_generated_tokens} generated, "
            f"{self.generated_tokens_per_s:.1f} generated tok/s ({self.model}, {self.mode})",
        ]
        if e.get("num_steps"):
            out.append(
                f"engine: {e['num_steps']} steps, step p50 {e['step_ms_p50']} ms / p99 {e['step_ms_p99']} ms, "
                f"{e['running_mean']} running on average (max {e['running_max']}), "
                f"KV blocks used max {e['kv_blocks_used_max']}/{e['kv_blocks_total']}, "
                f"{e['num_preemptions']} preemptions, {e['num_prefix_hit_tokens']} prefix-cache hit tokens")
        out.append(f"output: {self.output_dir}")
        return out
