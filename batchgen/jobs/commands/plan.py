"""`batchgen plan`: the dry run. Tokenize, plan, calibrate, estimate; write nothing.

It reads the input as `batchgen run` would (same checks, same prompts), plans every window with
batchgen.jobs.planning.planner (with --output naming a job's directory or object-store prefix, or one shard's
of a sharded job, only the rows a resume would run: the committed ones are counted, not planned, and
the output-length model the job saved there is used), and reports per window the rows, prompt and predicted
output lengths, the mode with its reason, the KV memory needed and an estimated time. Memory stays
bounded like the job's: one window of rows at a time, per-window aggregates, and bounded samples for
the job-wide quantiles.

Estimated time comes from a machine profile (batchgen.jobs.planning.profile): what an engine step costs
here, as overhead + seconds per token, applied to each window's predicted work, plus the model's
load, timed as the plan loads it (the run loads it the same way). `calibrate=True` measures the
profile with a short calibration run (batchgen.jobs.planning.estimate) and stores it; otherwise the
plan reads the stored one, else scales the built-in CPU one, and generates nothing: it costs the
model's load and the prompts' tokenization. The engine is sized as the run sizes its first one (a
small job's KV cache for its rows' needs), so the plan's batch sizes are the run's.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchgen.config.choices import Policy, Task
from batchgen.config.job import JobConfig
from batchgen.io.manifest.manifest import ManifestState, is_job_dir, load_manifest
from batchgen.io.store.factory import open_store
from batchgen.jobs.commands.prompt_check import prompts_unchanged
from batchgen.jobs.durability.resume import ResumeRule
from batchgen.jobs.openai.batch_task import resolve_batch_task
from batchgen.jobs.pipeline.context_check import check_room_for_prompts
from batchgen.jobs.pipeline.empty_input import input_is_empty
from batchgen.jobs.pipeline.prepare import open_inputs, prepare_job, seq_token_needs
from batchgen.jobs.pipeline.summary import plural
from batchgen.jobs.planning.output_size import OutputSize, size_text, text_bytes_per_token
from batchgen.jobs.sharding.sharded import shard_output_dir

if TYPE_CHECKING:
    from batchgen.engine.model.loader import LoadedModel


def plan_job(config: JobConfig, *, loaded: LoadedModel | None = None, calibrate: bool = False,
             calibration_rows: int = 16) -> dict[str, Any]:
    """The plan as JSON-ready data; raises BatchgenError subclasses for user mistakes."""
    resolve_batch_task(config)  # a Batch file of /v1/embeddings requests is planned as --task embed
    if Task(config.task) == Task.GENERATE:  # the other tasks keep no room for output
        check_room_for_prompts(config)  # as a run checks it: from the model's files, before any load
    inputs = open_inputs(config, need_output=False)
    if input_is_empty(config, inputs):  # a run would load no model and finish at once
        return {"empty_input": True, "inputs": inputs.scan.to_json(), "num_rows": 0, "windows": []}
    # the job's (or this shard's) output: a local directory or an object-store prefix, read, never written
    out = open_store(shard_output_dir(config.output, config.shard_index, config.num_shards)) if config.output else None
    # --overwrite: the run would start over, so nothing committed there is skipped or learned from
    out_dir = out if out is not None and is_job_dir(out) and not config.overwrite else None
    # a resume runs neither the committed rows nor, without --retry-errors, the committed error rows;
    # with --id-column a committed row counts as done only while its prompt hash is unchanged, as in a run
    check_prompts = config.id_column is not None
    state = load_manifest(out_dir, keep_hashes=check_prompts) if out_dir is not None else None
    resume = ResumeRule(state, config.retry_errors, check_prompts) if state is not None else None
    if resume is not None and (resume.nothing_to_do(inputs) or prompts_unchanged(config, inputs, resume)):
        return {"nothing_to_do": True, "output": str(out_dir), "num_rows": 0, "num_rows_done": state.num_committed_rows,
                "num_error_rows_done": len(state.error_ids), "windows": []}
    if Task(config.task) != Task.GENERATE:  # one forward pass per row: nothing to predict, no KV cache
        from batchgen.jobs.commands.plan_encode import plan_encode_job

        return plan_encode_job(config, inputs, resume=resume, calibrate=calibrate)
    # torch and transformers load here, once every check has passed
    from batchgen.engine.model.hf_imports import keep_torchao_out

    keep_torchao_out(config)  # before transformers loads: no torchao for a plan that does not quantize
    from batchgen.engine.model.loader import load_model
    from batchgen.jobs.pipeline.core import build_engine
    from batchgen.jobs.planning.duplicates import planned_copy
    from batchgen.jobs.planning.estimate import Tally, kv_bytes, window_seconds, window_work
    from batchgen.jobs.planning.estimate import calibrate as run_calibration
    from batchgen.jobs.planning.profile import Profile, load_profile, store_profile

    load_s = None  # a model handed in (tests) was loaded by someone else: no load time measured
    if loaded is None:
        started = time.perf_counter()  # the run loads the same model the same way: its time is part of the job's
        loaded = load_model(config.model, device=config.device, dtype=config.dtype,
                            trust_remote_code=config.trust_remote_code, quantize=config.quantize,
                            quantize_backend=config.quantize_backend, quantize_embedding=config.quantize_embedding)
        load_s = time.perf_counter() - started
    # the run's first engine: a small job's KV cache sized for its rows (jobs/executors/local.py)
    needs = seq_token_needs(config, inputs, loaded, resume or ResumeRule(ManifestState(), config.retry_errors,
                                                                          check_prompts))
    engine = build_engine(config, loaded, seq_token_needs=needs)
    job = prepare_job(config, inputs, loaded, engine, out_dir=out_dir, state=state)
    planner, block_size = job.planner, engine.block_size
    bytes_per_token = engine.kv_cache.spec.bytes_per_token  # of one pool block (kv/groups.py: one page per tensor pair)
    cache_bytes = engine.kv_cache.num_bytes
    # --lora adapters, held on the model's device beside the weights; the KV cache was sized after them
    lora = {name: {"rank": a.rank, "layers": a.num_layers, "bytes": a.device_bytes}
            for name, a in engine.lora_adapters.items()}
    budget = engine.limits.max_num_batched_tokens  # the step token budget (set or auto)

    rng = random.Random(0)
    prompt_tally, p50_tally, p90_tally = Tally(rng), Tally(rng), Tally(rng)
    windows: list[dict[str, Any]] = []
    work = []
    sample: list[list[int]] = []
    size = OutputSize([f.name for f in inputs.source.passthrough_fields])
    for plan in planner.plans(job.rows(on_error=lambda row, message: size.add(row.row_id, row.values))):
        if not sample:  # the calibration's prompts, and the text's bytes per token either way
            num_sample_rows = calibration_rows if calibrate and calibration_rows > 0 else 16
            step = max(1, plan.num_rows // num_sample_rows)  # spread over the window, not its longest rows
            sample = [r.prompt_token_ids for r in plan.rows[::step][:num_sample_rows]]
        for r in plan.rows:
            # a row with n samples writes n output rows, each with its own text
            size.add(r.row.row_id, r.row.values, copies=r.num_samples)
            prompt_tally.add(r.num_prompt_tokens)
            p50_tally.add(r.prediction.p50 * r.num_samples)
            p90_tally.add(r.prediction.p90 * r.num_samples)
        entry = plan.describe()
        entry["kv_bytes"] = kv_bytes(plan, plan.batch_size, block_size, bytes_per_token, engine.kv_window, budget,
                                     engine.kv_groups)
        windows.append(entry)
        work.append(window_work(plan, budget, lambda r: planned_copy(config, r), config.prefix_order))

    setup = {"model": loaded.name, "revision": loaded.revision, "device": str(loaded.device),
             "dtype": str(loaded.dtype), "quantization": loaded.quantization, "kv_cache_dtype": config.kv_cache_dtype,
             "attention": type(engine.backend).__name__}
    calibration = run_calibration(engine, sample) if sample and calibrate and calibration_rows > 0 else None
    if calibration is not None:
        store_profile(setup, calibration)
        profile: Profile | None = Profile(calibration, "calibrated")
    else:
        profile = load_profile(setup, device_type=loaded.device.type,
                               num_weights=sum(p.numel() for p in loaded.model.parameters()))
    total_s = (load_s or 0.0) if profile is not None and windows else None
    for entry, w in zip(windows, work, strict=True):
        if total_s is None:
            entry["estimated_seconds"] = None
            entry["estimates"] = None
            continue
        estimates = window_seconds(profile.calibration, w, entry["batch_size"], budget)
        entry["estimates"] = estimates
        entry["estimated_seconds"] = estimates[entry["mode"]]
        total_s += estimates[entry["mode"]]
    del engine

    return {
        "inputs": inputs.scan.to_json(), "model": loaded.name, "mode": config.mode,
        "window_rows": config.window_rows, "batch_size": config.batch_size or "auto",
        "max_num_batched_tokens": budget,
        "static_min_occupancy": config.static_min_occupancy,
        "num_rows": prompt_tally.count, "num_error_rows": job.num_error_rows, "num_rows_done": job.num_rows_skipped,
        "num_windows": len(windows),
        "num_windows_static": sum(s["mode"] == Policy.STATIC for s in windows),
        "prompt_tokens": prompt_tally.describe(), "predicted_output_tokens": p50_tally.total,
        "output_tokens_p50": p50_tally.describe(), "output_tokens_p90": p90_tally.describe(),
        "learned_rows": job.predictor.num_learned_rows,
        # prompt tokens of the rows to run that another row holds too; rows --dedup would serve
        "shareable_prefix_tokens": sum(w.shared_tokens for w in work),
        "prefix_order": config.prefix_order,
        "rows_from_duplicates": sum(w.num_copies for w in work),
        "lora": lora,
        "kv": {"bytes_per_token": bytes_per_token, "cache_bytes": cache_bytes,
               "cache_tokens": planner.kv_capacity_tokens,
               "needed_bytes_max": max((s["kv_bytes"]["needed"] for s in windows), default=0)},
        "calibration": None if calibration is None else {
            "num_rows": calibration.num_rows, "num_steps": calibration.num_steps,
            "step_overhead_ms": round(1000 * calibration.step_overhead_s, 3),
            "ms_per_token": round(1000 * calibration.seconds_per_token, 5)},
        "profile": None if profile is None else {
            "source": profile.source, "description": profile.describe(),
            "step_overhead_ms": round(1000 * profile.calibration.step_overhead_s, 3),
            "ms_per_token": round(1000 * profile.calibration.seconds_per_token, 5)},
        "model_load_seconds": None if load_s is None else round(load_s, 3),
        "estimated_seconds": None if total_s is None else round(total_s, 3),  # the model's load included
        "output_size": size.describe(p50_tally.total, text_bytes_per_token(loaded.tokenizer, sample)),
        "windows": windows,
    }


def plan_lines(report: dict[str, Any]) -> list[str]:
    """The plan for people: a header, then one line per window."""
    if report.get("empty_input"):
        return ["nothing to plan: the input holds no rows; a run would load no model, write _SUCCESS and exit 0"]
    if report.get("nothing_to_do"):
        return [f"nothing to do: all {report['num_rows_done']} rows are committed in {report['output']} "
                f"({plural(report['num_error_rows_done'], 'error row')}); a run there would load no model"]
    if report.get("task", Task.GENERATE.value) != Task.GENERATE.value:
        from batchgen.jobs.commands.plan_encode import plan_encode_lines

        return plan_encode_lines(report)
    p, o50, o90, kv = report["prompt_tokens"], report["output_tokens_p50"], report["output_tokens_p90"], report["kv"]
    done = f"; {report['num_rows_done']} committed before, not planned" if report["num_rows_done"] else ""
    lines = [
        f"plan: {plural(report['num_rows'], 'row')} ({plural(report['num_error_rows'], 'error row')}{done}) in "
        f"{plural(report['num_windows'], 'window')} of at most {report['window_rows']} rows; mode {report['mode']}: "
        f"{report['num_windows_static']} static, {report['num_windows'] - report['num_windows_static']} continuous",
        f"prompt tokens: mean {p['mean']}, p50 {p['p50']}, p90 {p['p90']}, max {p['max']}, total {p['total']}",
        f"predicted output tokens per row: p50 mean {o50['mean']} (p50 {o50['p50']}, p90 {o50['p90']}, max "
        f"{o50['max']}); p90 mean {o90['mean']}; total {report['predicted_output_tokens']}; learned from "
        f"{report['learned_rows']} earlier rows",
        f"KV cache: {size_text(kv['bytes_per_token'])} per token; the engine's cache holds {kv['cache_tokens']} tokens "
        f"({size_text(kv['cache_bytes'])}); the most a window needs at once: {size_text(kv['needed_bytes_max'])}",
    ]
    if report["shareable_prefix_tokens"] or report["rows_from_duplicates"]:
        how = ("computed once, by the first row of each group (--prefix-order)" if report["prefix_order"]
               else "read from the prefix cache only where it still holds them (--no-prefix-order)")
        lines.append(f"shared prompts: {report['shareable_prefix_tokens']} prompt tokens repeat another row's prefix, "
                     f"{how}; {plural(report['rows_from_duplicates'], 'row')} repeat another's prompt "
                     "(--dedup serves them); the estimated time counts both")
    size = report["output_size"]
    copied = ", ".join(f"{name} {size_text(n)}" for name, n in size["copied_columns"].items()) or "none"
    lines.append(f"output size: ~{size_text(size['total_bytes'])} uncompressed: generated text ~"
                 f"{size_text(size['generated_text_bytes'])} ({size['bytes_per_token']} bytes per token), copied input "
                 f"columns ~{size_text(size['copied_columns_bytes'])} ({copied}; --keep-columns chooses them)")
    if report["windows"]:
        first = report["windows"][0]
        lines.append(f"batch (first window): {first['batch_size_reason']}")
    cal, profile = report["calibration"], report["profile"]
    if cal is not None:
        lines.append(f"calibration: {cal['num_steps']} steps on {cal['num_rows']} rows: a step costs "
                     f"{cal['step_overhead_ms']} ms + {cal['ms_per_token']} ms per token; estimated time "
                     f"{report['estimated_seconds']:.1f} s{_load_part(report)}")
    elif profile is None:
        lines.append("estimated time: none (no machine profile for this device yet: --calibrate measures and "
                     "stores one)")
    elif report["estimated_seconds"] is not None:
        lines.append(f"estimated time {report['estimated_seconds']:.1f} s{_load_part(report)}: a step costs "
                     f"{profile['step_overhead_ms']} ms + {profile['ms_per_token']} ms per token, from "
                     f"{profile['description']}")
    lines.append(f"{'window':>6} {'rows':>7} {'mode':<10} {'est s':>9} {'occupancy':>9}  source (first row): reason")
    for s in report["windows"]:
        est = "-" if s["estimated_seconds"] is None else f"{s['estimated_seconds']:.1f}"
        lines.append(f"{s['index']:>6} {s['num_rows']:>7} {s['mode']:<10} {est:>9} {s['static_occupancy']:>9.0%}  "
                     f"{Path(s['path']).name} ({s['first_row']}): {s['reason']}")
    return lines


def _load_part(report: dict[str, Any]) -> str:
    load_s = report.get("model_load_seconds")
    return "" if load_s is None else f" (model load {load_s:.1f} s, measured here, + generation)"
