"""The kernels' shared ground: the dtype codes said once in C (csrc/common.h) and once in Python
(common.py) and equal, restated nowhere else; and every csrc/ header self-contained, compiling on its
own (it includes what it uses and calls nothing its includer defines)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from batchgen.engine.kernels import common, loader

C_NAMES = {"F32": torch.float32, "BF16": torch.bfloat16, "I8": torch.int8, "F16": torch.float16}
HAS_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))


def test_the_dtype_codes_are_the_same_in_c_and_in_python():
    text = (loader.CSRC / "common.h").read_text()
    codes = {name: int(value) for name, value in re.findall(r"^#define DTYPE_(\w+) (\d+)", text, flags=re.M)}
    assert set(codes) == set(C_NAMES)
    assert {C_NAMES[name]: value for name, value in codes.items()} == common.DTYPE_CODES
    assert len(set(codes.values())) == len(codes), "one code per dtype"


@pytest.mark.parametrize("path", sorted(loader.CSRC.glob("*.[ch]")), ids=lambda p: p.name)
def test_no_c_file_restates_the_ground(path):
    if path.name == "common.h":
        return
    text = path.read_text()
    assert "#define ALWAYS_INLINE" not in text
    assert "#define DTYPE_" not in text, "a dtype code of its own"
    assert not re.search(r"dtype\s*[=!]=\s*\d", text), "a dtype compared with a number, not common.h's name"


@pytest.mark.parametrize("path", sorted(Path(common.__file__).parent.glob("*.py")), ids=lambda p: p.name)
def test_no_binding_restates_the_codes(path):
    if path.name == "common.py":
        return
    assert not re.search(r"torch\.\w+: \d", path.read_text()), "a dtype code table of its own"


@pytest.mark.skipif(not HAS_CC, reason="needs a C compiler")
@pytest.mark.parametrize("header", sorted(loader.CSRC.glob("*.h")), ids=lambda p: p.name)
def test_each_header_compiles_on_its_own(header):
    cmd = [loader.compiler(), *loader.CFLAGS, "-Werror=implicit-function-declaration", "-fsyntax-only", "-x", "c",
           str(header)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
