#!/usr/bin/env python3
"""Counts of the fault-injection suite, read from pytest's junit XML files.

    python tools/fault_report.py JUNIT_XML... [--out FILE.json]

The suite is every test marked ``fault`` (pytest.ini): a rank with other arguments, a dead, late or
interrupted peer, a corrupted or forged word, handle or record, a pre-created name or folder, ranks in
other PID namespaces. Its CPU part runs with ``pytest -m "fault and not (gpu or multigpu)"
--junitxml=FILE``, its GPU part with ``bash tools/gpu.sh OUT faults`` (OUT/junit_<pkg>.xml).
tests/conftest.py gives each such test the junit property ``fault``; the tests that measure how long the
detection took record ``detect_s`` (``record_property``). Testcases without the ``fault`` property
(the rest of a full run) are ignored.

Per package (``tests/<package>/`` of the test's file or class name) the report counts the fault tests
that ran, passed (the fault was detected with the named error, and the test's own checks that nothing
was lost or left behind held), failed (errors included) and skipped, and the detection times
(count, min, median, max). It prints a table, then the failed tests; ``--out`` also writes JSON.

Exit status: 0 no fault test failed; 1 one failed; 2 a usage error (a file missing or not junit XML,
or no fault test in the files).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

FAULT_PROPERTY = "fault"
DETECT_PROPERTY = "detect_s"


@dataclass
class Counts:
    """One package's fault tests: outcomes, the failed ones' ids and the detection times recorded."""
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    failed_tests: list = field(default_factory=list)
    detect_s: list = field(default_factory=list)  # (test id, seconds)

    @property
    def ran(self) -> int:
        return self.passed + self.failed

    def add(self, other: "Counts") -> None:
        self.passed += other.passed
        self.failed += other.failed
        self.skipped += other.skipped
        self.failed_tests += other.failed_tests
        self.detect_s += other.detect_s

    def detect_summary(self) -> "dict | None":
        """count, min, median and max of the detection times, or None without any."""
        if not self.detect_s:
            return None
        values = [s for _, s in self.detect_s]
        return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values)}

    def as_dict(self) -> dict:
        return {"ran": self.ran, "passed": self.passed, "failed": self.failed, "skipped": self.skipped,
                "failed_tests": self.failed_tests, "detect_s": self.detect_summary(),
                "detect_s_by_test": [{"test": t, "seconds": s} for t, s in self.detect_s]}


def package_of(testcase: ET.Element) -> str:
    """The ``tests/<package>/`` folder of a testcase (xunit1's ``file``, else its ``classname``), or "other"."""
    path = testcase.get("file")
    parts = path.replace("\\", "/").split("/") if path else (testcase.get("classname") or "").split(".")
    for i in range(len(parts) - 2):  # the folder after tests/, not the test module itself
        if parts[i] == "tests":
            return parts[i + 1]
    return "other"


def _properties(testcase: ET.Element) -> list:
    return [(p.get("name"), p.get("value")) for props in testcase.findall("properties")
            for p in props.findall("property")]


def read_junit(path: str) -> dict:
    """The fault tests of one junit XML file, as {package: Counts}.

    Arguments:
        path: a file pytest wrote with ``--junitxml``.
    Returns:
        {package: Counts} of the testcases carrying the ``fault`` property.
    Raises:
        ValueError: the file is missing, not XML, or not a junit report (naming the file).
    """
    try:
        root = ET.parse(path).getroot()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (ET.ParseError, OSError) as e:
        raise ValueError(f"{path}: not readable as junit XML ({e})") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"{path}: not a junit report (root element <{root.tag}>)")
    out: dict = {}
    for tc in root.iter("testcase"):
        props = _properties(tc)
        if not any(name == FAULT_PROPERTY for name, _ in props):
            continue
        test_id = f"{tc.get('classname', '')}::{tc.get('name', '')}"
        counts = out.setdefault(package_of(tc), Counts())
        if tc.find("failure") is not None or tc.find("error") is not None:
            counts.failed += 1
            counts.failed_tests.append(test_id)
        elif tc.find("skipped") is not None:
            counts.skipped += 1
        else:
            counts.passed += 1
        for name, value in props:
            if name != DETECT_PROPERTY:
                continue
            try:
                counts.detect_s.append((test_id, float(value)))
            except (TypeError, ValueError):
                raise ValueError(f"{path}: {test_id} recorded detect_s={value!r}, not a number") from None
    return out


def collect(paths: list) -> dict:
    """{package: Counts} over every file, packages in name order.

    Raises:
        ValueError: a file is unreadable (see ``read_junit``), or no file holds a fault test.
    """
    total: dict = {}
    for path in paths:
        for pkg, counts in read_junit(path).items():
            total.setdefault(pkg, Counts()).add(counts)
    if not total:
        raise ValueError("no testcase with the junit property 'fault' in " + ", ".join(paths)
                         + " (run pytest with -m fault from the repository, whose tests/conftest.py adds it)")
    return dict(sorted(total.items()))


def _fmt_detect(summary: "dict | None") -> str:
    if summary is None:
        return "-"
    return f"{summary['n']}: {summary['min']:.2f} / {summary['median']:.2f} / {summary['max']:.2f}"


def total_of(packages: dict) -> Counts:
    total = Counts()
    for counts in packages.values():
        total.add(counts)
    return total


def table(packages: dict) -> str:
    """The report as text: one row per package and a total, then the failed tests."""
    total = total_of(packages)
    head = ("package", "ran", "passed", "failed", "skipped", "detect_s n: min / median / max")
    rows = [head] + [(pkg, str(c.ran), str(c.passed), str(c.failed), str(c.skipped), _fmt_detect(c.detect_summary()))
                     for pkg, c in list(packages.items()) + [("total", total)]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if i in (0, 5) else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             .rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"faults injected (fault tests run): {total.ran}; detected with the named error and nothing "
                 f"lost or left behind (passed): {total.passed}; failed: {total.failed}; skipped: {total.skipped}")
    lines += [f"FAILED {t}" for t in total.failed_tests]
    return "\n".join(lines)


def main(argv: "list | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", nargs="+", metavar="JUNIT_XML", help="pytest --junitxml files")
    parser.add_argument("--out", metavar="FILE.json", help="also write the counts as JSON")
    args = parser.parse_args(argv)
    try:
        packages = collect(args.junit)
    except ValueError as e:
        print(f"fault_report: {e}", file=sys.stderr)
        return 2
    print(table(packages))
    if args.out:
        doc = {"files": args.junit, "packages": {p: c.as_dict() for p, c in packages.items()},
               "total": total_of(packages).as_dict()}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 1 if any(c.failed for c in packages.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
