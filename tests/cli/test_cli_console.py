"""What the CLI prints around a job: help, interrupts while starting up, other people's progress bars."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app


@pytest.mark.parametrize("command", ["run", "plan"])
def test_help_names_values_not_python_types_and_marks_required_options(command):
    text = " ".join(CliRunner().invoke(app, [command, "--help"]).output.split())  # unwrapped
    assert not re.search(r"<\w+(\[\w+\])?>", text), "a metavar shows a Python type"
    assert "-i, --input PATH Input file" in text
    assert "--output DIR" in text and "--prompt-column COL" in text and "--max-new-tokens, --max-tokens N" in text
    assert text.count("required, here or in --config") == (2 if command == "run" else 1)


# A Ctrl-C while the heavy imports run: simulated by an import hook that raises KeyboardInterrupt
# where `import torch` would be, at the point a real one lands most often (seconds of importing).
INTERRUPTED_IMPORT = """
import sys
class Interrupting:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupting())
from batchgen.cli import main
sys.argv = ["batchgen", *sys.argv[1:]]
main()
"""


def test_interrupt_while_starting_up_says_so_and_exits_130(tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a"]}), src)
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT, "run", "-i", str(src), "-o", str(tmp_path / "out"),
                           "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1] == ("error: interrupted by SIGINT while starting up, before any row was generated; "
                         "nothing was committed")
    assert "Traceback" not in proc.stderr


# A start-up that takes its time (the heavy imports): it says when it got there, then waits.
SLOW_IMPORT = """
import sys, time
class Slow:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.stderr.write("importing torch\\n")
            sys.stderr.flush()
            time.sleep(60)
sys.meta_path.insert(0, Slow())
from batchgen.cli import main
sys.argv = ["batchgen", *sys.argv[1:]]
main()
"""


def test_a_background_job_of_a_script_stops_on_an_early_sigint(tmp_path):
    """bash starts `batchgen run ... &` with SIGINT ignored; the CLI handles it from start-up on."""
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a"]}), src)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_IMPORT, "run", "-i", str(src), "-o", str(tmp_path / "out"),
                             "--quiet"], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert proc.stderr.readline() == "importing torch\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted by SIGINT while starting up" in err


QUIET_GGUF_BAR = """
import sys
from batchgen.cli.console import setup_logging
setup_logging(quiet=True)
from tqdm.auto import tqdm   # what transformers' GGUF reader draws its conversion bar with
for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
    pass
"""


def test_quiet_silences_other_libraries_progress_bars():
    proc = subprocess.run([sys.executable, "-c", QUIET_GGUF_BAR], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "GGUF" not in proc.stderr, repr(proc.stderr)
