"""Write tests/durations.json from a pytest JUnit report: each test module's seconds (setup, call and teardown
of its tests), which tests/conftest.py uses to start the longest modules first.

    .venv/bin/python -m pytest -q -p no:xdist --junitxml=report.xml tests
    .venv/bin/python tools/test_durations.py report.xml
"""
import argparse
import collections
import json
import os
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_seconds(report: str) -> dict[str, float]:
    """Seconds per test file (its path from the repository root), longest first; modules under a second left out."""
    seconds = collections.Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        seconds[case.get("classname").replace(".", "/") + ".py"] += float(case.get("time"))
    return {module: round(s, 1) for module, s in seconds.most_common() if s >= 1.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="a pytest --junitxml report of the whole suite, run without workers")
    parser.add_argument("--out", default=os.path.join(ROOT, "tests", "durations.json"))
    args = parser.parse_args(argv)
    try:
        seconds = module_seconds(args.report)
    except (OSError, ET.ParseError) as err:  # the old durations stay: every pytest run orders the suite by them
        parser.error(f"cannot read the report {args.report}: {err}")
    temporary = args.out + ".tmp"
    with open(temporary, "w") as f:
        json.dump(seconds, f, indent=1)
        f.write("\n")
    os.replace(temporary, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
