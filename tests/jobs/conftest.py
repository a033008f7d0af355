"""Fixtures of the job tests: the tiny models loaded once per module, as a user's --model loads them."""

from __future__ import annotations

import pytest

from batchgen.engine.model.loader import load_model


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    """The tiny Llama loaded once per module, handed to run_job as a user's --model would load."""
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def loaded_eos(eos_model_dir):
    """The EOS-happy tiny Llama (eos_model_dir) loaded once per module."""
    return load_model(str(eos_model_dir), device="cpu", dtype="float32")
