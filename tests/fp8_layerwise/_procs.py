"""Process helpers of the liveness tests: an independent reader of /proc/<pid>/stat and a child
process that stays alive until told to stop.

proc(5): field 2 of /proc/<pid>/stat is the command name in parentheses, which may itself contain
spaces and parentheses, so the fields after it start after the *last* ')'; field 3 is the state,
field 22 the start time in clock ticks.
"""
import subprocess
import sys


def proc_stat(pid):
    """(comm, state, start time) of ``pid`` from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read().decode("utf-8", "surrogateescape")
    comm = raw[raw.index("(") + 1: raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2:].split(" ")  # fields 3, 4, ...
    return comm, fields[0], int(fields[22 - 3])


def sleeper(name=None):
    """A child Python process that sets its command name to ``name`` (prctl PR_SET_NAME), prints
    "ready" and lives until its stdin closes (``stop``)."""
    code = ("import ctypes, sys\n"
            "name = sys.argv[1].encode()\n"
            "if name:\n"
            "    assert ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name), 0, 0, 0) == 0\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-c", code, name or ""], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def stop(p):
    """Ends a ``sleeper`` and reaps it."""
    p.stdin.close()
    p.wait(30)
