"""`batchgen plan` for --task embed, score and classify: tokenize as the run would, count the packed
batches, estimate time and output size; load no weights.

These tasks predict nothing (a row is one forward pass of its exact length) and have no KV cache,
so the plan is the rows' token lengths, the batches the encoder packs them into, the time the
machine profile gives those batches (batchgen.jobs.planning.encode_estimate) and the output the
task's columns weigh. The model's files tell what the plan needs (the tokenizer, the input limit,
an embed job's dimension, a classifier's labels, the weight count); only where they cannot (a hub
id not in the local cache, the default GGUF not converted yet) is the model loaded, as the run
would load it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from batchgen.config.choices import Task
from batchgen.config.job import JobConfig
from batchgen.engine.encode.batching import engine_prefill
from batchgen.errors import ConfigError
from batchgen.io.manifest.manifest import ManifestState
from batchgen.jobs.durability.resume import ResumeRule
from batchgen.jobs.encoding.embedding_dim import embedding_dim_from_files
from batchgen.jobs.encoding.encode_core import encode_inputs, sort_for_encoder
from batchgen.jobs.encoding.encode_rows import encode_prompt_builder, prepare_encode_row
from batchgen.jobs.encoding.task_setup import load_encode_model_for
from batchgen.jobs.pipeline.prepare import JobInputs, PreparedJob
from batchgen.jobs.pipeline.summary import plural
from batchgen.jobs.planning.encode_estimate import (
    EncodeWork,
    budget_tokens,
    encode_output_size,
    labels_from_files,
    num_weights_from_files,
    task_bytes_per_row,
)
from batchgen.jobs.planning.estimate import Tally
from batchgen.jobs.planning.output_size import OutputSize, size_text
from batchgen.jobs.planning.planner import windows
from batchgen.jobs.planning.profile import REFERENCE_NUM_WEIGHTS, load_profile


def plan_encode_job(config: JobConfig, inputs: JobInputs, *, resume: ResumeRule | None,
                    calibrate: bool) -> dict[str, Any]:
    """The plan of an embed, score or classify job as JSON-ready data."""
    from batchgen.engine.model.loader import load_tokenizer, resolve_device
    from batchgen.engine.model.model_files import DEFAULT_MODEL, model_files_identity

    task = Task(config.task)
    if calibrate:
        raise ConfigError(f"--calibrate times generation steps, and --task {task} generates nothing: plan it "
                          "without --calibrate (its time comes from the stored or built-in machine profile)")
    path = model_files_identity(config.model, config.dtype)["path"]
    found = load_tokenizer(config.model, trust_remote_code=config.trust_remote_code)
    loaded = None
    if found is None:  # the files alone cannot tell: load the model as the run would
        loaded = load_encode_model_for(config)
        tokenizer, max_input_tokens = loaded.tokenizer, loaded.max_input_tokens
    else:
        tokenizer, context_tokens = found
        max_input_tokens = min(_max_seq_length(path) or context_tokens, context_tokens)
    embedding_dim = labels = None
    if task == Task.EMBED:
        embedding_dim = embedding_dim_from_files(path, config.dimensions)
        if embedding_dim is None:
            loaded = loaded or load_encode_model_for(config)
            embedding_dim = min(loaded.embedding_dim, config.dimensions or loaded.embedding_dim)
    elif task == Task.CLASSIFY:
        labels = labels_from_files(path) or (list((getattr(loaded, "id2label", None) or {}).values()) or None)

    check_prompts = config.id_column is not None
    builder = encode_prompt_builder(config, tokenizer, inputs.source.template, max_input_tokens)
    job = PreparedJob(config, inputs.source, builder, None, None,
                      resume or ResumeRule(ManifestState(), config.retry_errors, check_prompts),
                      prepare=lambda row: prepare_encode_row(row, builder, config))
    device = resolve_device(config.device)
    work = EncodeWork(budget_tokens(config.max_num_batched_tokens, device.type), config.batch_size,
                      padded_attention=not engine_prefill(task, device.type))
    tally = Tally(random.Random(0))
    size = OutputSize([f.name for f in inputs.source.passthrough_fields])
    num_truncated = 0
    for window in windows(job.rows(on_error=lambda row, message: size.add(row.row_id, row.values)),
                          config.window_rows):
        for r in sort_for_encoder(window):  # the order the run hands them to the encoder
            lengths = [len(ids) for ids in encode_inputs(r)]
            size.add(r.row.row_id, r.row.values, copies=len(lengths))
            num_truncated += r.num_truncated_tokens > 0
            for n in lengths:
                tally.add(n)
            work.add(lengths)

    if config.model in (None, DEFAULT_MODEL):
        num_weights = REFERENCE_NUM_WEIGHTS  # the built-in profile's own model
    elif loaded is not None:
        num_weights = sum(p.numel() for p in loaded.model.parameters())
    else:
        num_weights = num_weights_from_files(path)
    setup = {"model": str(path or config.model), "task": task.value, "device": str(device), "dtype": config.dtype}
    profile = load_profile(setup, device_type=device.type, num_weights=num_weights) if num_weights else None
    bytes_per_row = task_bytes_per_row(task, embedding_dim=embedding_dim, labels=labels)
    return {
        "task": task.value, "inputs": inputs.scan.to_json(), "model": config.model or DEFAULT_MODEL,
        "num_rows": tally.count, "num_error_rows": job.num_error_rows,
        "num_rows_done": job.num_rows_skipped, "num_truncated_rows": num_truncated,
        "max_input_tokens": max_input_tokens, "embedding_dim": embedding_dim,
        "num_labels": None if labels is None else len(labels), "num_weights": num_weights,
        "prompt_tokens": tally.describe(), "num_batches": work.num_batches,
        "max_num_batched_tokens": work.budget_tokens,
        "profile": None if profile is None else {
            "source": profile.source, "description": profile.describe(),
            "step_overhead_ms": round(1000 * profile.calibration.step_overhead_s, 3),
            "ms_per_token": round(1000 * profile.calibration.seconds_per_token, 5)},
        "model_load_seconds": None,  # no weights are read: the run adds their load
        "estimated_seconds": None if profile is None else work.seconds(profile.calibration),
        "output_size": encode_output_size(size, bytes_per_row),
        "windows": [],
    }


def plan_encode_lines(report: dict[str, Any]) -> list[str]:
    """The plan of an embed, score or classify job for people."""
    p, task = report["prompt_tokens"], report["task"]
    done = f"; {report['num_rows_done']} committed before, not planned" if report["num_rows_done"] else ""
    what = {"embed": f"a {report['embedding_dim']}-dimension embedding", "score": "its log-likelihood",
            "classify": f"a label of {report['num_labels'] or '?'} and their scores"}[task]
    lines = [
        f"plan (--task {task}): {plural(report['num_rows'], 'row')} ({plural(report['num_error_rows'], 'error row')}"
        f"{done}), each one forward pass writing {what}; nothing to predict, no KV cache",
        f"input tokens: mean {p['mean']}, p50 {p['p50']}, p90 {p['p90']}, max {p['max']}, total {p['total']}; "
        f"the model reads at most {report['max_input_tokens']} ({plural(report['num_truncated_rows'], 'row')} cut)",
        f"batches: {report['num_batches']} packed batches of at most {report['max_num_batched_tokens']} tokens",
    ]
    size = report["output_size"]
    copied = ", ".join(f"{name} {size_text(n)}" for name, n in size["copied_columns"].items()) or "none"
    lines.append(f"output size: ~{size_text(size['total_bytes'])} uncompressed: task columns "
                 f"~{size_text(size['task_columns_bytes'])} ({size['bytes_per_row']} bytes per row), copied input "
                 f"columns ~{size_text(size['copied_columns_bytes'])} ({copied}; --keep-columns chooses them)")
    profile = report["profile"]
    if profile is None:
        lines.append("estimated time: none (no machine profile for this device and model)")
    else:
        lines.append(f"estimated time {report['estimated_seconds']:.1f} s plus the model's load: a batch costs "
                     f"{profile['step_overhead_ms']} ms + {profile['ms_per_token']} ms per token, from "
                     f"{profile['description']}")
    return lines


def _max_seq_length(path: str | None) -> int | None:
    """sentence-transformers' input limit (sentence_bert_config.json): longer inputs are cut there."""
    if path is None or not Path(path).is_dir():
        return None
    try:
        value = json.loads((Path(path) / "sentence_bert_config.json").read_text(encoding="utf-8"))["max_seq_length"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and value > 0 else None
