"""Fixtures every package's tests share: the tiny models of tests/tiny.py, saved as a user would
pass them. Each test package has its own conftest.py for what only it needs (tests/jobs: the
loaded models; tests/io: the part writer); the S3 server fixtures of tests/s3_server.py, which
both use, are loaded here as a plugin. Test files import plain helpers from tests/tiny.py,
tests/jobs/helpers.py and tests/s3_server.py, never from a conftest."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_tiny_model, make_tokenizer

pytest_plugins = ("tests.s3_server",)  # the S3 server fixtures of the io, jobs and ray tests


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
