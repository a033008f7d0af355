"""Fixtures of the job tests: the tiny models loaded once per module, as a user's --model loads them."""

from __future__ import annotations

import pytest

from batchgen.config.constraint import InvalidConstraint
from batchgen.engine.model.loader import load_model
from batchgen.engine.sampling.grammar import GrammarMasks


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    """The tiny Llama loaded once per module, handed to run_job as a user's --model would load."""
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def loaded_eos(eos_model_dir):
    """The EOS-happy tiny Llama (eos_model_dir) loaded once per module."""
    return load_model(str(eos_model_dir), device="cpu", dtype="float32")


@pytest.fixture()
def uncompilable(monkeypatch):
    """A constraint that llguidance accepts without a tokenizer but that fails to compile against it
    (as a grammar past the lexer's limits for a large vocabulary does): any whose text holds the marker."""
    real = GrammarMasks.compiled

    def compiled(self, constraint):
        if "UNCOMPILABLE" in constraint.spec:
            raise InvalidConstraint("initial lexer configuration (grammar) too big")
        return real(self, constraint)

    monkeypatch.setattr(GrammarMasks, "compiled", compiled)
