"""tools/torchrun.py: a run's output as it comes; an error that stops the ranks as one line with the full log's path
— not every rank's traceback and torchrun's ChildFailedError report (which go to the log)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = '''
import argparse, os, sys, time
sys.path.insert(0, {root!r})
from megatron_ais.errors import ArgumentValidationError, reported_as_one_line

from megatron_ais.flags import FlagParser

parser = (FlagParser if os.environ.get("FLAG_PARSER") else argparse.ArgumentParser)(prog="rank.py")
parser.add_argument("--fail", choices=("none", "runtime", "usage"))
args = parser.parse_args()
with reported_as_one_line(parser.prog, parser):
    for step in range(1, 201):
        print(f"rank {{os.environ['RANK']}} step", step, flush=True)
    if args.fail == "runtime":
        raise RuntimeError("the engine died\\n  at step 3")
    if args.fail == "usage":
        raise ArgumentValidationError("--lr -1 must be positive: pass a learning rate > 0")
'''


def _launch(tmp_path, *flags, env=None):
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT.format(root=ROOT))
    log = tmp_path / "logs" / "run.log"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "torchrun.py"), "--log", str(log),
                             "--standalone", "--nproc-per-node", "2", str(script), *flags],
                            capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    return result, log.read_text()


@pytest.mark.parametrize("fail, line", [
    ("runtime", "rank.py: error: RuntimeError: the engine died at step 3"),
    ("usage", "rank.py: error: --lr -1 must be positive: pass a learning rate > 0"),
    ("bogus", "rank.py: error: argument --fail: invalid choice: 'bogus' (choose from 'none', 'runtime', 'usage')")])
def test_a_failed_run_is_one_line_with_the_logs_path(tmp_path, fail, line):
    result, log = _launch(tmp_path, "--fail", fail)
    assert result.returncode != 0
    console = result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"{line} (full log: {tmp_path / 'logs' / 'run.log'})"
    assert "Traceback" not in console and "ChildFailedError" not in console and "usage:" not in console, console
    assert console.count("error:") == 1, console
    if fail == "runtime":  # the ranks' tracebacks are in the log, with torchrun's report
        assert log.count("Traceback") >= 2 and "ChildFailedError" in log


def test_a_flag_error_of_our_parser_is_one_line(tmp_path):
    # the entry points' FlagParser prints no usage block: its error alone must end the console's output
    result, _ = _launch(tmp_path, "--fail", "bogus", env={"FLAG_PARSER": "1"})
    console = result.stdout + result.stderr
    assert result.returncode != 0 and console.count("error:") == 1, console
    assert result.stderr.strip().splitlines()[-1] == (
        "rank.py: error: argument --fail: invalid choice: 'bogus' (choose from 'none', 'runtime', 'usage') "
        f"(full log: {tmp_path / 'logs' / 'run.log'})")


def test_a_run_that_succeeds_shows_all_its_output(tmp_path):
    result, log = _launch(tmp_path, "--fail", "none")
    assert result.returncode == 0 and result.stderr == ""
    # two ranks printing into one pipe at once: every line whole
    assert sorted(result.stdout.splitlines()) == sorted(f"rank {rank} step {step}" for rank in (0, 1)
                                                        for step in range(1, 201))
    assert "rank 0 step 200" in log
