"""torchrun for people: the run's output as it comes, and an error that ends it as one line and where the full log is.

    python tools/torchrun.py [--log FILE] TORCHRUN_ARGS... SCRIPT SCRIPT_ARGS...

Runs `python -m torch.distributed.run` with the same arguments. Every line the ranks and torchrun print goes to the
log (default runs/logs/SCRIPT-TIME.log) and to the console until the run fails: a rank that ends with an error writes
it as one line to a file (`errors.reported_as_one_line`) and its traceback to the log only; once that file has a line,
or torchrun reports a failed rank, or argparse prints a usage, the console gets nothing more of the run's output, and
at the end one line: the first error (each distinct one once) and the log's path. The exit status is torchrun's.
"""
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_ais.errors import ERROR_FILE_ENV  # noqa: E402

# torchrun's report of a failed rank, an argparse usage or error (printed by every rank; our FlagParser prints
# 'prog: error: ...' without the usage)
FAILURE_STARTS = re.compile(r"(torch\.distributed\.elastic.*failed \(exitcode|ChildFailedError|^usage: |^\S+: error: )")
ARGPARSE_ERROR = re.compile(r"^\S+: error: ")


def split_log_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--log's value or None, the rest of argv)."""
    if len(argv) >= 2 and argv[0] == "--log":
        return argv[1], argv[2:]
    return None, argv


def default_log(torchrun_args: list[str]) -> str:
    script = next((a for a in torchrun_args if a.endswith(".py")), "run")
    stem = os.path.splitext(os.path.basename(script))[0]
    return os.path.join("runs", "logs", f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.log")


def first_errors(error_file: str) -> list[str]:
    """The distinct one-line errors the ranks wrote, the lowest rank's first."""
    if not os.path.exists(error_file):
        return []
    with open(error_file) as f:
        records = sorted((int(rank), line) for rank, _, line in (r.rstrip("\n").partition("\t") for r in f if r.strip()))
    return list(dict.fromkeys(line for _, line in records))


def failure_line(errors: list[str], held: list[str], returncode: int, log: str) -> str:
    """What the console shows of a failed run: the ranks' errors, else argparse's, else the exit status."""
    if not errors:
        errors = [line.rstrip("\n") for line in held if ARGPARSE_ERROR.match(line)][-1:]
    what = "; ".join(errors) if errors else f"a rank exited with status {returncode}"
    return f"{what} (full log: {log})"


def main(argv: list[str]) -> int:
    log, torchrun_args = split_log_flag(argv)
    log = log or default_log(torchrun_args)
    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    error_file = log + ".errors"
    if os.path.exists(error_file):
        os.remove(error_file)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{ERROR_FILE_ENV: error_file})
    held = []
    with open(log, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *torchrun_args], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in process.stdout:
            log_file.write(line)
            log_file.flush()
            if not held and (FAILURE_STARTS.search(line) or os.path.exists(error_file)):
                held.append(line)
            elif held:
                held.append(line)
            else:
                sys.stdout.write(line)
                sys.stdout.flush()
        returncode = process.wait()
    errors = first_errors(error_file)
    if os.path.exists(error_file):
        os.remove(error_file)
    if returncode == 0:
        sys.stdout.writelines(held)
        return 0
    print(failure_line(errors, held, returncode, log), file=sys.stderr)
    return returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
