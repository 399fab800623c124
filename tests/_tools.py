"""Helpers for tests of the scripts in tools/ (which are not packages)."""
import importlib.util
import os
import sys
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")


def load_tool(name: str) -> ModuleType:
    """Import ``tools/<name>.py`` as a module (its ``main`` is not run). tools/ goes on ``sys.path`` (at
    the end), as for a script run there: the tools import one another by name, and so do the ranks
    that tools/_launch.py spawns."""
    if TOOLS not in sys.path:
        sys.path.append(TOOLS)
    path = os.path.join(TOOLS, f"{name}.py")
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == path:
        # Once per process: a second module object would make the first one's functions unpicklable
        # (spawned ranks look them up by name) and its dataclasses other classes.
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses (and pickling) look their module up there
    spec.loader.exec_module(mod)
    return mod
