"""batchgen bench: both policies generate exactly the workload's tokens and report throughput."""

from __future__ import annotations

import torch

from batchgen.engine.model.loader import LoadedModel
from batchgen.jobs.commands.bench import default_engine_configs, make_workload, run_bench
from tests.tiny import VOCAB_SIZE, make_tiny_model


def test_bench_runs_both_policies_round_robin(tokenizer):
    model = make_tiny_model("llama")
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name="tiny", revision="x", device=torch.device("cpu"),
                         dtype=torch.float32, eos_token_ids=[2], max_context_tokens=512)
    workload = make_workload(12, mean_prompt_tokens=20, mean_output_tokens=8, mixed=True, vocab_size=VOCAB_SIZE,
                             max_tokens=200)
    result = run_bench(loaded, workload, default_engine_configs(4, 64, 4 << 20), repeats=2)
    assert set(result) == {"continuous", "static"}
    for r in result.values():
        assert len(r["runs"]) == 2 and r["tokens_per_s_min"] > 0


def test_uniform_workload_has_equal_lengths():
    w = make_workload(5, mean_prompt_tokens=7, mean_output_tokens=3, mixed=False, vocab_size=100)
    assert {len(p) for p in w.prompt_token_ids} == {7} and set(w.output_lens) == {3}
    assert w.num_output_tokens == 15


def test_bench_command_prints_both_policies(tiny_model_dir):
    import json

    from typer.testing import CliRunner

    from batchgen.cli import app

    result = CliRunner().invoke(app, ["bench", "--model", str(tiny_model_dir), "--num-requests", "6",
                                      "--prompt-tokens", "8", "--output-tokens", "4", "--batch-size", "4",
                                      "--kv-cache-memory", "4MiB", "--repeats", "1", "--device", "cpu",
                                      "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(data) == {"continuous", "static"}


def test_bench_report_shows_both_policies(tiny_model_dir, tmp_path):
    import json
    import re

    from typer.testing import CliRunner

    from batchgen.cli import app

    result = CliRunner().invoke(app, ["bench", "--model", str(tiny_model_dir), "--num-requests", "16",
                                      "--prompt-tokens", "8", "--output-tokens", "8", "--batch-size", "4",
                                      "--kv-cache-memory", "4MiB", "--repeats", "1", "--device", "cpu",
                                      "--dtype", "float32", "--report", str(tmp_path / "r"), "--png"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    html = (tmp_path / "r" / "report.html").read_text()
    assert len(re.findall(r'src="data:image/png;base64,', html)) == 5
    assert "continuous vs static" in html
    pngs = sorted(p.name for p in (tmp_path / "r").glob("*.png"))
    assert pngs == sorted(f"bench_{n}.png" for n in ("tokens_per_s", "over_time", "running", "kv", "step_times"))
    assert set(data) == {"continuous", "static"}
