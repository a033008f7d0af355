"""The length planner: windows, run order, the mode per window and its reason; then, through
run_job on the tiny random Llama, that the plan never changes a row's output: static equals
continuous under greedy decoding, rows that overrun a far too low prediction still finish, mode
switches between windows, the static fallback after an injected engine fault, and the learned
lengths saved for the next run."""

from __future__ import annotations

import json
import logging
import math
import random

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchgen.config.choices import Policy
from batchgen.config.job import build_config
from batchgen.engine.engine import LLMEngine
from batchgen.engine.model.loader import load_model
from batchgen.errors import ConfigError, EngineError
from batchgen.io.inputs.discovery import InputFile
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.pipeline import core, prepare
from batchgen.jobs.planning.length import LENGTH_MODEL_FILE, LengthPredictor
from batchgen.jobs.planning.planner import Planner, reserved_tokens, static_batches, windows
from batchgen.jobs.rows.planned_row import PlannedRow
from batchgen.jobs.rows.rows import InputRow

# ---------------------------------------------------------------- planner decisions (no model)

FILE_A = InputFile("/data/a.parquet", "parquet", None)
FILE_B = InputFile("/data/b.parquet", "parquet", None)


def rows(prompt_lens, *, max_new=256, known=None, file=FILE_A) -> list[PlannedRow]:
    known = known if known is not None else [None] * len(prompt_lens)
    return [PlannedRow(InputRow(f"{file.path}:{i}", file, i, {}), [7] * n, max_new, 0, k)
            for i, (n, k) in enumerate(zip(prompt_lens, known, strict=True))]


def planner(predictor=None, **overrides) -> Planner:
    values = dict(inputs=["x"], output="o", batch_size=16, window_rows=256)
    values.update(overrides)
    return Planner(build_config(None, **values), predictor or LengthPredictor({}))


def test_uniform_outputs_run_static_whatever_the_prompts():
    """Prompt lengths never idle a static slot: alike outputs make a window uniform."""
    prompts = [random.Random(i).randint(5, 120) for i in range(64)]
    plan = planner().plan(rows(prompts, known=[10] * 64))
    assert plan.mode == Policy.STATIC and plan.static_occupancy == 1.0
    assert plan.reason.startswith("uniform") and "exact lengths" in plan.reason
    assert plan.total_cv > 0.3  # the totals vary a lot: that is not what decides


def test_prompt_heavy_uniform_outputs_run_continuous():
    """Alike outputs, but a static batch's prompts outgrow one step: continuous decodes meanwhile."""
    prompts = [random.Random(i).randint(500, 2000) for i in range(64)]
    plan = planner(max_num_batched_tokens=2048).plan(rows(prompts, known=[100] * 64))
    assert plan.mode == Policy.CONTINUOUS and plan.static_occupancy == 1.0
    assert plan.reason.startswith("prompt-heavy") and "steps to prefill" in plan.reason
    # the same rows with a step budget that takes each batch's prompts at once stay static
    roomy = planner(max_num_batched_tokens=16 * 2000).plan(rows(prompts, known=[100] * 64))
    assert roomy.mode == Policy.STATIC, roomy.reason


def test_unknown_lengths_run_continuous():
    plan = planner().plan(rows([50] * 64))
    assert plan.mode == Policy.CONTINUOUS and plan.static_occupancy == pytest.approx(0.5, abs=0.01)
    assert plan.reason.startswith("mixed") and "(prior)" in plan.reason


def test_mixed_known_lengths_sorted_into_alike_batches():
    """Heavy-tailed outputs: unsorted static batches idle most slots; sorted ones are far busier."""
    rng = random.Random(0)
    known = [max(1, min(512, int(math.exp(rng.gauss(4, 1))))) for _ in range(256)]
    unsorted = planner(sort_by_length=False).plan(rows([30] * 256, max_new=512, known=known))
    ordered = planner().plan(rows([30] * 256, max_new=512, known=known))
    assert unsorted.mode == Policy.CONTINUOUS and unsorted.static_occupancy < 0.5
    assert ordered.static_occupancy > 1.5 * unsorted.static_occupancy
    assert [r.row.row_index for r in unsorted.rows] == list(range(256))  # --no-sort-by-length: input order
    assert [r.prediction.p50 for r in ordered.rows] == sorted(known, reverse=True)  # continuous, longest first


def test_learned_tight_lengths_turn_a_window_static():
    predictor = LengthPredictor({})
    before = planner(predictor, static_min_occupancy=0.95).plan(rows([40] * 32))
    for i in range(200):
        predictor.observe(40, 100 + i % 3)
    after = planner(predictor, static_min_occupancy=0.95).plan(rows([40] * 32))  # p50 101, p90 102
    assert before.mode == Policy.CONTINUOUS and after.mode == Policy.STATIC, (before.reason, after.reason)
    assert {r.prediction.source for r in after.rows} == {"bin"}


def test_static_order_is_longest_first_and_batches_fit_the_cache():
    forced = planner(mode="static").plan(rows([10] * 4, known=[5, 50, 20, 50]))
    assert (forced.mode, forced.reason) == (Policy.STATIC, "--mode static")
    assert [r.prediction.p50 for r in forced.rows] == [50, 50, 20, 5]
    auto = planner().plan(rows([10] * 4, known=[5, 50, 20, 50]))  # one batch, 125 of 200 slots busy
    assert auto.mode == Policy.CONTINUOUS and auto.static_occupancy == 0.625
    assert [r.prediction.p50 for r in auto.rows] == [50, 50, 20, 5]  # continuous too: short rows drain last
    assert planner(mode="continuous").plan(rows([10], known=[5])).reason == "--mode continuous"
    alike = planner(mode="static").plan(rows([10] * 6, known=[6] * 6)).rows
    # 10 + 6 tokens fill one block of 16: a cache of 5 blocks holds 5 such rows per batch
    assert static_batches(alike, 16, 5 * 16, 16) == [5, 1]
    assert static_batches(alike, 4, None, 16) == [4, 2]


def test_a_rows_samples_count_as_sequences():
    """n = 4: a static batch of 8 sequences holds 2 rows, and the plan's tokens count every sample."""
    planned = rows([40] * 6, known=[10] * 6)
    for r in planned:
        r.num_samples = 4
    p = planner(batch_size=8)
    plan = p.plan(planned)
    assert plan.static_batches == [2, 2, 2]
    described = plan.describe()
    assert (described["num_rows"], described["num_sequences"], described["predicted_output_tokens"]) == (6, 24, 240)
    assert p.num_predicted_tokens == 240
    # a row asking for more samples than a batch holds still runs, alone
    assert static_batches(planned[:2], 2, None, 16) == [1, 1]
    # reservations: the prompt's full blocks once, its partial block and the output per sample
    assert reserved_tokens(planned[0], 10, 16) == (4 + 3 * 2) * 16  # 40 + 10 -> 4 blocks; 8 + 10 -> 2 each
    assert static_batches(planned, 8, 2 * 160, 16) == [2, 2, 2]
    assert static_batches(planned, 8, 2 * 160 - 1, 16) == [1] * 6


def test_windows_split_by_file_and_size():
    mixed = rows([5] * 5) + rows([5] * 2, file=FILE_B)
    sizes = [(w[0].row.file.path, len(w)) for w in windows(mixed, 2)]
    assert sizes == [(FILE_A.path, 2), (FILE_A.path, 2), (FILE_A.path, 1), (FILE_B.path, 2)]
    p = planner(window_rows=3)
    plans = list(p.plans(mixed))
    assert [(s.index, s.first_row_index, s.num_rows) for s in plans] == [(0, 0, 3), (1, 3, 2), (2, 0, 2)]


# ---------------------------------------------------------------- through run_job

MAX_NEW = 12


@pytest.fixture(scope="module")
def loaded(eos_model_dir):
    return load_model(str(eos_model_dir), device="cpu", dtype="float32")


# the last two stop at EOS (after 4 and 6 tokens) on this model; the rest run to their budget
TEXTS = [f"row {i}: " + "lorem ipsum dolor sit amet "[: 3 + (7 * i) % 25] for i in range(12)] + ["zzzz zzzz",
                                                                                                 "1234567890"]
BUDGETS = [3 + (5 * i) % 10 for i in range(12)] + [MAX_NEW, MAX_NEW]


def write_input(path, texts=TEXTS, **columns):
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts, **columns}), path)
    return path


def job(src, out, model_dir, **overrides):
    values = dict(inputs=[str(src)] if not isinstance(src, list) else [str(s) for s in src], output=str(out),
                  model=str(model_dir), device="cpu", dtype="float32", chat=False, id_column="id",
                  max_new_tokens=MAX_NEW, kv_cache_memory="16MiB", quiet=True, batch_size=4)
    values.update(overrides)
    return build_config(None, **values)


def output(out) -> dict:
    table = ds.dataset(str(out), format="parquet").to_table()
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "an id appears twice"
    keep = ("generated_text", "finish_reason", "num_generated_tokens", "num_prompt_tokens")
    return {row["id"]: {k: row[k] for k in keep} for row in table.to_pylist()}


@pytest.fixture(scope="module")
def reference(eos_model_dir, loaded, tmp_path_factory):
    """Continuous mode, input order: what every planned run must produce row for row."""
    tmp = tmp_path_factory.mktemp("plan-reference")
    src = write_input(tmp / "in.parquet", budget=BUDGETS)
    summary = run_job(job(src, tmp / "out", eos_model_dir, mode="continuous", max_new_tokens_column="budget"),
                      loaded=loaded)
    assert summary.num_windows_continuous == 1 and summary.num_windows_static == 0
    result = output(tmp / "out")
    assert {r["finish_reason"] for r in result.values()} == {"stop", "length"}  # both ways a row ends
    return src, result


@pytest.mark.parametrize("overrides", [dict(mode="static"), dict(mode="static", sort_by_length=False),
                                       dict(mode="auto", window_rows=5)], ids=["static", "unsorted", "auto"])
def test_static_and_auto_equal_continuous_under_greedy(eos_model_dir, loaded, reference, tmp_path, overrides):
    src, expected = reference
    summary = run_job(job(src, tmp_path / "out", eos_model_dir, max_new_tokens_column="budget", **overrides),
                      loaded=loaded)
    assert output(tmp_path / "out") == expected
    assert summary.num_rows == len(TEXTS) and summary.num_static_fallbacks == 0
    if overrides["mode"] == "static":
        assert summary.num_windows_static == 1
    else:
        assert summary.num_windows_static + summary.num_windows_continuous == 3


def test_rows_far_past_their_prediction_still_finish(eos_model_dir, loaded, reference, tmp_path, monkeypatch):
    """--length-column claims 1 token for every row: each static reservation is far too small, the
    engine parks the overrunning rows and finishes them later, and no row is cut short."""
    src, expected = reference
    table = pq.read_table(src).append_column("known", pa.array([1] * len(TEXTS)))
    pq.write_table(table, tmp_path / "in.parquet")
    seen = []
    add = LLMEngine.add_request

    def spy(self, request):
        seen.append(request.predicted_num_output_tokens)
        return add(self, request)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    summary = run_job(job(tmp_path / "in.parquet", tmp_path / "out", eos_model_dir, mode="static",
                          max_new_tokens_column="budget", length_column="known"), loaded=loaded)
    assert seen == [1] * len(TEXTS)
    assert output(tmp_path / "out") == expected
    assert summary.engine["num_overruns"] > 0
    assert summary.length_sources == {"exact": len(TEXTS)}
    assert summary.length_mae > 0  # the claim was wrong, and the summary says by how much


def test_each_window_gets_its_own_mode(eos_model_dir, loaded, tmp_path):
    """Two files: alike lengths (static) and lengths a batch cannot hide (continuous); one engine
    at a time, rebuilt at each switch; the output equals an all-continuous run."""
    a = write_input(tmp_path / "a.parquet", TEXTS[:8], budget=[6] * 8)
    b = write_input(tmp_path / "b.parquet", TEXTS[8:11], budget=[1, 1, 12])
    b_ids = pq.read_table(b).set_column(0, "id", pa.array([100, 101, 102]))
    pq.write_table(b_ids, b)
    built = []
    original = core.build_engine

    def counting(config, loaded, mode=None, **kwargs):
        built.append(mode)
        return original(config, loaded, mode, **kwargs)

    results = {}
    for mode in ("auto", "continuous"):
        built.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(core, "build_engine", counting)
            summary = run_job(job([a, b], tmp_path / mode, eos_model_dir, mode=mode, ignore_eos=True,
                                  max_new_tokens_column="budget"), loaded=loaded)
        results[mode] = output(tmp_path / mode)
        if mode == "auto":
            assert (summary.num_windows_static, summary.num_windows_continuous) == (1, 1)
            assert built == [Policy.CONTINUOUS, Policy.STATIC, Policy.CONTINUOUS]
            assert summary.length_mae == 0 and summary.length_spearman == pytest.approx(1.0)
            assert summary.engine["num_requests_finished"] == 11
    assert results["auto"] == results["continuous"]
    assert all(r["num_generated_tokens"] == (6 if i < 100 else [1, 1, 12][i - 100])
               for i, r in results["auto"].items())


@pytest.mark.parametrize("fault", [RuntimeError("injected fault"), EngineError("injected engine error")],
                         ids=["exception", "EngineError"])
def test_a_continuous_engine_fault_reruns_the_window_static(eos_model_dir, loaded, reference, tmp_path, monkeypatch,
                                                           caplog, fault):
    src, expected = reference
    steps = []
    step = LLMEngine.step

    def flaky(self):
        if self.config.policy is Policy.CONTINUOUS:
            steps.append(1)
            if len(steps) == 5:  # mid-window: rows running, rows finished, rows not yet admitted
                raise fault
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", flaky)
    with caplog.at_level(logging.WARNING, logger="batchgen"):
        summary = run_job(job(src, tmp_path / "out", eos_model_dir, mode="continuous", window_rows=6,
                              max_new_tokens_column="budget"), loaded=loaded)
    assert summary.num_static_fallbacks == 1
    assert "continuous engine failed" in caplog.text and str(fault) in caplog.text
    assert output(tmp_path / "out") == expected  # every row once, as if nothing had failed
    assert summary.num_rows == len(TEXTS) and summary.complete
    assert summary.engine["num_requests_finished"] == len(TEXTS)
    assert json.loads((tmp_path / "out" / "_summary.json").read_text())["num_static_fallbacks"] == 1


def test_user_errors_and_our_own_failures_are_not_engine_faults(eos_model_dir, loaded, reference, tmp_path,
                                                               monkeypatch, caplog):
    src, _ = reference

    def config_error(self):
        raise ConfigError("a user's mistake")

    monkeypatch.setattr(LLMEngine, "step", config_error)
    with pytest.raises(ConfigError, match="a user's mistake"):
        run_job(job(src, tmp_path / "a", eos_model_dir, mode="continuous"), loaded=loaded)
    monkeypatch.undo()

    prepare_row = prepare.prepare_row
    calls = []

    def broken(row, builder, config, **kwargs):
        calls.append(row.row_index)
        if len(calls) == 9:  # while the engine runs the first rows: raised through engine.generate
            raise RuntimeError("a bug in the row stream")
        return prepare_row(row, builder, config, **kwargs)

    monkeypatch.setattr(prepare, "prepare_row", broken)
    with pytest.raises(RuntimeError, match="a bug in the row stream"):
        run_job(job(src, tmp_path / "b", eos_model_dir, mode="continuous", window_rows=4), loaded=loaded)
    assert "continuous engine failed" not in caplog.text


def test_learned_lengths_are_saved_and_reused(eos_model_dir, loaded, tmp_path):
    src = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    first = run_job(job(src, out, eos_model_dir, max_rows=10), loaded=loaded)
    saved = json.loads((out / LENGTH_MODEL_FILE).read_text())
    assert saved["global"]["count"] == 10 and saved["key"]["model"] == str(eos_model_dir)
    assert first.length_sources == {"prior": 10} and first.length_mae is not None
    rest = run_job(job(src, out, eos_model_dir), loaded=loaded)  # the same job, resumed: starts informed
    assert rest.num_rows_skipped == 10 and rest.num_rows == len(TEXTS) - 10
    assert set(rest.length_sources) <= {"bin", "global"}
    assert json.loads((out / LENGTH_MODEL_FILE).read_text())["global"]["count"] == len(TEXTS)
    assert not list(out.glob(".*"))
