"""tools/fault_report.py, the counts of the fault-injection suite, over small synthetic junit files, and end
to end: a pytest run with the repository's conftest and pytest.ini writes the ``fault`` and ``detect_s``
properties the report reads."""
import json
import os
import subprocess
import sys

import pytest

from tests._tools import ROOT, load_tool

REPORT = os.path.join(ROOT, "tools", "fault_report.py")

# xunit1 (pytest.ini's junit_family: file attributes) for two packages, plus a testcase without the
# fault property, which the report ignores.
XUNIT1 = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="6">
 <testcase classname="tests.fp8_layerwise.test_multiproc" name="test_kill[a]" file="tests/fp8_layerwise/test_multiproc.py">
  <properties><property name="fault" value="1"/><property name="detect_s" value="0.04"/></properties></testcase>
 <testcase classname="tests.fp8_layerwise.test_multiproc" name="test_kill[b]" file="tests/fp8_layerwise/test_multiproc.py">
  <properties><property name="fault" value="1"/><property name="detect_s" value="0.02"/></properties></testcase>
 <testcase classname="tests.fp8_layerwise.test_multiproc" name="test_late" file="tests/fp8_layerwise/test_multiproc.py">
  <properties><property name="fault" value="1"/><property name="detect_s" value="0.9"/></properties>
  <failure message="AssertionError">left behind: /dev/shm/x</failure></testcase>
 <testcase classname="tests.fp8_layerwise.test_single" name="test_delivery" file="tests/fp8_layerwise/test_single.py"/>
 <testcase classname="tests.ipc_all2all.test_exchange_cpu" name="test_malformed" file="tests/ipc_all2all/test_exchange_cpu.py">
  <properties><property name="fault" value="1"/></properties></testcase>
 <testcase classname="tests.ipc_all2all.test_gpu" name="test_dead_peer" file="tests/ipc_all2all/test_gpu.py">
  <properties><property name="fault" value="1"/></properties><skipped message="needs 2 CUDA device(s)"/></testcase>
</testsuite></testsuites>
"""
# xunit2 (no file attribute: the package comes from the class name), a single testsuite root, an error.
XUNIT2 = """<?xml version="1.0" encoding="utf-8"?>
<testsuite name="pytest" tests="2">
 <testcase classname="tests.elastic_ep.test_peer_death_gpu" name="test_dies[combine]">
  <properties><property name="fault" value="1"/><property name="detect_s" value="1.5"/></properties></testcase>
 <testcase classname="tests.elastic_ep.test_peer_death_gpu" name="test_dies[dispatch]">
  <properties><property name="fault" value="1"/></properties><error message="fixture failed"/></testcase>
</testsuite>
"""


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _report(*args):
    return subprocess.run([sys.executable, REPORT, *args], capture_output=True, text=True, timeout=60)


def test_counts_per_package_and_detection_times(tmp_path):
    fr = load_tool("fault_report")
    packages = fr.collect([_write(tmp_path, "a.xml", XUNIT1), _write(tmp_path, "b.xml", XUNIT2)])
    assert list(packages) == ["elastic_ep", "fp8_layerwise", "ipc_all2all"]
    fp8, ipc, ep = packages["fp8_layerwise"], packages["ipc_all2all"], packages["elastic_ep"]
    assert (fp8.ran, fp8.passed, fp8.failed, fp8.skipped) == (3, 2, 1, 0)  # test_delivery is no fault test
    assert fp8.failed_tests == ["tests.fp8_layerwise.test_multiproc::test_late"]
    assert fp8.detect_summary() == {"n": 3, "min": 0.02, "median": 0.04, "max": 0.9}
    assert (ipc.ran, ipc.passed, ipc.failed, ipc.skipped) == (1, 1, 0, 1) and ipc.detect_summary() is None
    assert (ep.ran, ep.passed, ep.failed) == (2, 1, 1)  # an error counts as failed
    assert ep.failed_tests == ["tests.elastic_ep.test_peer_death_gpu::test_dies[dispatch]"]


def test_prints_a_table_writes_json_and_fails_when_a_fault_test_failed(tmp_path):
    out = tmp_path / "faults.json"
    proc = _report(_write(tmp_path, "a.xml", XUNIT1), _write(tmp_path, "b.xml", XUNIT2), "--out", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr  # two fault tests failed
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.strip()}
    assert rows["fp8_layerwise"][1:5] == ["3", "2", "1", "0"] and "3: 0.02 / 0.04 / 0.90" in proc.stdout
    assert rows["ipc_all2all"][1:6] == ["1", "1", "0", "1", "-"]
    assert rows["total"][1:5] == ["6", "4", "2", "1"]
    assert ("faults injected (fault tests run): 6; detected with the named error and nothing lost or left "
            "behind (passed): 4; failed: 2; skipped: 1") in proc.stdout
    assert "FAILED tests.fp8_layerwise.test_multiproc::test_late" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["total"]["ran"] == 6 and doc["total"]["detect_s"]["n"] == 4 and doc["total"]["detect_s"]["max"] == 1.5
    assert doc["packages"]["elastic_ep"]["detect_s_by_test"] == [
        {"test": "tests.elastic_ep.test_peer_death_gpu::test_dies[combine]", "seconds": 1.5}]
    # Every fault test passed (or skipped): exit status 0.
    assert _report(_write(tmp_path, "ok.xml", XUNIT1.replace("<failure", "<!--").replace("</failure>", "-->"))
                   ).returncode == 0


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    ("not xml <", "not readable as junit XML"),
    ("<html/>", "not a junit report (root element <html>)"),
    ('<testsuite><testcase classname="tests.x.t" name="n"/></testsuite>',
     "no testcase with the junit property 'fault'"),
    ('<testsuite><testcase classname="tests.x.t" name="n"><properties><property name="fault" value="1"/>'
     '<property name="detect_s" value="soon"/></properties></testcase></testsuite>', "recorded detect_s='soon'"),
], ids=["missing", "not xml", "not junit", "no fault test", "bad detect_s"])
def test_bad_input_is_a_usage_error_naming_the_file(tmp_path, content, message):
    path = str(tmp_path / "j.xml") if content is None else _write(tmp_path, "j.xml", content)
    proc = _report(path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert proc.stdout == ""


_TESTS = """import pytest


@pytest.mark.fault
def test_detected(record_property):
    record_property("detect_s", 0.25)


@pytest.mark.fault
def test_left_something_behind():
    assert False, "left behind"


def test_not_a_fault():
    pass
"""


def test_the_fault_marker_reaches_the_junit_file_through_the_repositorys_conftest(tmp_path):
    # tests/conftest.py gives a test marked fault the junit property the report counts; pytest.ini
    # registers the marker and writes xunit1 (no warning for record_property).
    pkg = tmp_path / "tests" / "demo_pkg"
    pkg.mkdir(parents=True)
    (pkg / "test_demo.py").write_text(_TESTS)
    xml = tmp_path / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "-c", os.path.join(ROOT, "pytest.ini"), "--rootdir", str(tmp_path), str(pkg),
                           f"--junitxml={xml}", "-W", "error::pytest.PytestWarning"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 1 and "1 failed, 2 passed" in proc.stdout, proc.stdout + proc.stderr
    packages = load_tool("fault_report").collect([str(xml)])
    demo = packages["demo_pkg"]
    assert list(packages) == ["demo_pkg"] and (demo.ran, demo.passed, demo.failed) == (2, 1, 1)
    assert demo.detect_s == [("tests.demo_pkg.test_demo::test_detected", 0.25)]
