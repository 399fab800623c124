"""The shared-memory names one test creates, told apart from every other process's.

Other tests (and other packages' test runs) use /dev/shm at the same time, so a test must not
compare the whole listing before and after, nor unlink every ``fp8lw_*`` name it finds. Instead,
:func:`tagged_segments` makes every ``ShmSegment.create(prefix, n)`` of this process (the only
way the package creates a segment: ``ControlRegion.create`` and ``HostSlots.create``) use the prefix
``<prefix>_<tag>`` with a tag unique to the test, and records the names; ``linked()`` lists the
/dev/shm entries carrying the tag, i.e. the names this test created that still exist.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import threading
from typing import Iterator, List

from fp8_layerwise import _C

SHM_DIR = "/dev/shm"

#: Python source that a child process runs (``-c``) to tag its segments with ``sys.argv[TAG_ARGV]``.
CHILD_TAG_CODE = ("from fp8_layerwise import _C as _C_\n"
                  "_create_ = _C_.ShmSegment.create\n"
                  "_C_.ShmSegment.create = staticmethod(lambda prefix, n: _create_(prefix + '_' + _tag_, n))\n")


def new_tag() -> str:
    return "t" + secrets.token_hex(8)


def spawn_tagged(body: str, *args: str, **popen_kw):
    """A child Python process running ``body`` with its segments tagged; ``sys.argv[1]`` is the tag,
    ``sys.argv[2:]`` are ``args``. Returns ``(process, tag)``."""
    import subprocess
    import sys

    tag = new_tag()
    code = "import sys\n_tag_ = sys.argv[1]\n" + CHILD_TAG_CODE + body
    return subprocess.Popen([sys.executable, "-c", code, tag, *args], **popen_kw), tag


def linked_with_tag(tag: str) -> List[str]:
    """The /dev/shm entries whose name carries ``tag`` (sorted, without the leading '/')."""
    return sorted(n for n in os.listdir(SHM_DIR) if f"_{tag}_" in n)


class Tracker:
    def __init__(self, tag: str):
        self.tag = tag
        self.created: List[str] = []  # names as ShmSegment.name gives them ("/fp8lw_ctl_<tag>_<hex>")
        self._lock = threading.Lock()

    def linked(self) -> List[str]:
        return linked_with_tag(self.tag)

    def unlink_all(self) -> None:
        for n in self.linked():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, n))


@contextlib.contextmanager
def tagged_segments() -> Iterator[Tracker]:
    """Within the block, every segment this process creates carries a fresh tag (see the module doc).
    Leftovers carrying the tag are unlinked on the way out, so a failing test leaks nothing."""
    tracker = Tracker(new_tag())
    cls = _C.ShmSegment
    original = cls.__dict__["create"]
    create = cls.create

    def tagged_create(prefix, nbytes):
        seg = create(f"{prefix}_{tracker.tag}", nbytes)
        with tracker._lock:
            tracker.created.append(seg.name)
        return seg

    cls.create = staticmethod(tagged_create)
    try:
        yield tracker
    finally:
        cls.create = original
        tracker.unlink_all()
