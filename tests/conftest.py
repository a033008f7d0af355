"""Shared fixtures: the tiny models of tests/tiny.py, saved and loaded as a user would pass them,
and helpers more than one test file needs.

One conftest for the whole tree: the engine's attention tests still `from conftest import` the
tiny models, which a second conftest.py (imported under the same module name) would break.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.loader import load_model
from batchgen.io.writers import PartWriter, publish_staged

# re-exported for the engine's attention tests, which still import them from here
from tests.tiny import VOCAB_SIZE, make_tiny_model, make_tokenizer  # noqa: F401


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy shared machine OpenMP threads
    waiting on each other make every step ~10x slower; subprocess jobs run with OMP_NUM_THREADS=1
    too, so an in-process run matches them."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A tiny Llama + tokenizer saved as a local HF directory (safetensors), as a user would pass."""
    path = tmp_path_factory.mktemp("tiny-llama")
    model = make_tiny_model("llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def eos_model_dir(tmp_path_factory, tokenizer):
    """A tiny Llama whose raised EOS logit makes some greedy rows stop early: varied output lengths."""
    path = tmp_path_factory.mktemp("tiny-llama-eos")
    make_tiny_model("llama", eos_boost=12.0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ---------------------------------------------------------------- jobs


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    """The tiny Llama loaded once per module, handed to run_job as a user's --model would load."""
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


# ---------------------------------------------------------------- io


@pytest.fixture
def write_part():
    """Write rows as one visible part (stage, then publish), all or nothing: the part write a job
    does without the manifest. On failure nothing of the part is left and the name is reused."""

    def write(writer: PartWriter, rows):
        seq = writer.next_seq
        try:
            staged = writer.stage_part(rows)
            try:
                publish_staged([staged])
            except BaseException:
                staged.temp_path.unlink(missing_ok=True)
                staged.final_path.unlink(missing_ok=True)
                raise
        except BaseException:
            writer.next_seq = seq
            raise
        return staged.final_path

    return write


@pytest.fixture(scope="module")
def loaded_eos(eos_model_dir):
    """The EOS-happy tiny Llama (eos_model_dir) loaded once per module."""
    return load_model(str(eos_model_dir), device="cpu", dtype="float32")
