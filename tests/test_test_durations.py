"""tools/test_durations.py sums a JUnit report's test times per module (what tests/conftest.py orders the suite by),
and tests/durations.json names only test modules that exist."""
import json
import os

import test_durations
from conftest import ROOT

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.rollout.test_engine" name="test_a" time="12.5"/>
<testcase classname="tests.rollout.test_engine" name="test_b[1]" time="2.25"/>
<testcase classname="tests.test_wandb" name="test_c" time="30.0"/>
<testcase classname="tests.test_quick" name="test_d" time="0.4"/>
</testsuite></testsuites>"""


def test_module_seconds_are_summed_longest_first_and_short_modules_left_out(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text(REPORT)
    seconds = test_durations.module_seconds(str(report))
    assert list(seconds.items()) == [("tests/test_wandb.py", 30.0), ("tests/rollout/test_engine.py", 14.8)]
    out = tmp_path / "durations.json"
    assert test_durations.main([str(report), "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == seconds


def test_a_missing_or_broken_report_leaves_the_durations_as_they_were(tmp_path, capsys):
    # the file was emptied before the report was read, and every pytest run then failed reading it
    out = tmp_path / "durations.json"
    out.write_text('{"tests/test_wandb.py": 30.0}\n')
    (tmp_path / "cut.xml").write_text(REPORT[:80])
    for report in (tmp_path / "missing.xml", tmp_path / "cut.xml"):
        try:
            test_durations.main([str(report), "--out", str(out)])
        except SystemExit as exit:
            assert exit.code == 2 and f"cannot read the report {report}" in capsys.readouterr().err
        else:
            raise AssertionError("a report that cannot be read was accepted")
        assert out.read_text() == '{"tests/test_wandb.py": 30.0}\n'


def test_the_committed_durations_name_existing_test_modules():
    with open(os.path.join(ROOT, "tests", "durations.json")) as f:
        seconds = json.load(f)
    assert seconds and all(os.path.isfile(os.path.join(ROOT, module)) for module in seconds), \
        [module for module in seconds if not os.path.isfile(os.path.join(ROOT, module))]
