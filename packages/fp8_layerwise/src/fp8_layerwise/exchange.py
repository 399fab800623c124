"""How the ranks of a transport find each other: an all-gather of small objects during the setup.

:func:`group_exchange` goes through a torch.distributed group (gloo is enough); :class:`FileExchange`
through a private folder, without torch.distributed. The checks below run on the first exchange's
result, on every rank, so that every rank raises the same ValueError before anything is created.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets
import shutil
import stat
import time
from typing import Any, Callable, List, Optional, Sequence

from . import _C
from ._checks import MAX_TP, _check, _check_seconds, _int_arg


def _proc_start_time(pid: int) -> Optional[int]:
    """Start time of a live (not zombie) process, else None (the native liveness check's reading)."""
    try:
        start = _C.process_start_time(int(pid))
    except (TypeError, ValueError, OverflowError):
        return None
    return start or None


def _private_folder_problem(path: pathlib.Path) -> Optional[str]:
    """Why ``path`` is not a folder only this user controls, or None. Another local user who owns the
    folder, may write into it, or swapped it for a symbolic link could plant session and round files
    (which carry shared-memory names) or read ours."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None  # nothing there to trust or distrust (a session that ended)
    except OSError as e:
        return f"cannot be inspected ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _write_private(path: pathlib.Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, owner-only (0600): the files carry shm names."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class FileExchange:
    """Explicit all-gather through a private folder (no torch.distributed needed).

    Sessions: rank 0's first call creates a fresh session folder ``<dir>/s.<random nonce>`` (0700)
    and points ``<dir>/session.json`` at it, with its pid and ``/proc`` start time; every other rank
    joins the session it names only if that process is alive and the rank's seat in it is free
    (``join.<rank>``, created ``O_EXCL``). Files that an earlier run left in the same folder are
    never read: a finished run removed its session, and a crashed one's leader is dead or its
    seats are taken. Each call writes ``<session>/<round>.<rank>.json`` (0600, atomically) and waits
    for every rank's file; a rank's file of round k is removed once every rank reached round k+1.
    ``close()`` (also called by :class:`Transport` once its setup is done, or once it failed) ends the
    session: rank 0 waits until every rank that joined closed, then removes the session folder and
    ``session.json`` (also when a rank never came, or the wait ran out). Raises ``TimeoutError`` after
    ``timeout_s`` without the awaited file, naming the rank.
    """

    SESSION_FILE = "session.json"

    def __init__(self, directory: os.PathLike, rank: int, world_size: int, timeout_s: float = 60.0):
        _check(isinstance(directory, (str, os.PathLike)),
               f"directory must be a path (str or os.PathLike), got {type(directory).__name__}")
        world_size = _int_arg("world_size", world_size, 1)
        rank = _int_arg("rank", rank, 0, world_size - 1)
        _check_seconds("timeout_s", timeout_s)
        self.dir = pathlib.Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = _private_folder_problem(self.dir)
        _check(problem is None, f"directory: {self.dir} {problem}; FileExchange needs a folder of this user "
                                "that nobody else can write (e.g. tempfile.mkdtemp(), or chmod 700)")
        self.rank, self.world_size, self.timeout_s, self.round = rank, world_size, float(timeout_s), 0
        self.session: Optional[pathlib.Path] = None
        self._closed = False

    # ---- session ---------------------------------------------------------------------------
    def _create_session(self) -> pathlib.Path:
        self._remove_dead_sessions()
        nonce = secrets.token_hex(16)
        session = self.dir / f"s.{nonce}"
        session.mkdir(mode=0o700)
        leader = {"nonce": nonce, "pid": os.getpid(), "start": _proc_start_time(os.getpid()),
                  "world_size": self.world_size}
        _write_private(session / "leader.json", json.dumps(leader))
        _write_private(self.dir / self.SESSION_FILE, json.dumps(leader))
        return session

    @staticmethod
    def _leader_alive(leader: dict) -> bool:
        start = _proc_start_time(leader.get("pid", -1))
        return start is not None and start == leader.get("start")

    def _remove_dead_sessions(self) -> None:
        """Best effort: remove session folders whose leader process is gone (a crashed run's)."""
        for d in self.dir.glob("s.*"):
            if _private_folder_problem(d) is not None:
                continue  # not ours to read or remove
            try:
                leader = json.loads((d / "leader.json").read_text())
            except (OSError, ValueError):
                continue
            if not self._leader_alive(leader):
                shutil.rmtree(d, ignore_errors=True)

    def _join_session(self, deadline: float) -> pathlib.Path:
        why = f"no {self.SESSION_FILE} yet"
        while True:
            try:
                leader = json.loads((self.dir / self.SESSION_FILE).read_text())
            except (OSError, ValueError):
                leader = None
            if leader is not None:
                session = self.dir / f"s.{leader.get('nonce')}"
                if leader.get("world_size") != self.world_size:
                    why = f"its session is for world_size {leader.get('world_size')}, not {self.world_size}"
                elif not self._leader_alive(leader):
                    why = f"the session it names was left by process {leader.get('pid')}, which is gone"
                else:
                    problem = _private_folder_problem(session)
                    _check(problem is None, f"FileExchange in {self.dir}: the session folder {session.name} that "
                                            f"{self.SESSION_FILE} names {problem}; refusing to join it")
                    try:
                        os.close(os.open(session / f"join.{self.rank}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                        return session
                    except FileExistsError:
                        why = f"rank {self.rank}'s seat in the session it names is taken (an earlier run's)"
                    except FileNotFoundError:
                        why = "the session it names has ended"
            if time.monotonic() > deadline:
                raise TimeoutError(f"FileExchange in {self.dir}: rank 0 has not started a session for rank "
                                   f"{self.rank} within {self.timeout_s} s ({why})")
            time.sleep(0.002)

    # ---- rounds ----------------------------------------------------------------------------
    def __call__(self, obj: Any) -> List[Any]:
        """One all-gather round.

        Arguments:
            obj: this rank's entry (JSON-serialisable).

        Returns:
            Every rank's entry of this round, in rank order.

        Raises:
            TimeoutError: a rank's entry (or, for a rank other than 0, rank 0's session) did not
                appear within ``timeout_s``.
            RuntimeError: rank 0 closed the session before this rank's round (it left).
        """
        if self._closed:
            raise RuntimeError(f"FileExchange in {self.dir} (rank {self.rank}) is closed (Transport closes the "
                               "FileExchange it was given once its setup is done); create a new one")
        # Serialised first: an object JSON refuses must leave the round count (and the session) as
        # they were, else this rank's next round would be one ahead of its peers', which wait for it.
        text = json.dumps(obj)
        deadline = time.monotonic() + self.timeout_s
        if self.session is None:
            self.session = self._create_session() if self.rank == 0 else self._join_session(deadline)
        self.round += 1
        try:
            _write_private(self.session / f"{self.round}.{self.rank}.json", text)
        except FileNotFoundError:
            if self.session.is_dir():
                raise
            raise RuntimeError(f"FileExchange round {self.round} (rank {self.rank}): its session {self.session} has "
                               "ended: rank 0 closed it (it left the exchange)") from None
        out = []
        for r in range(self.world_size):
            p = self.session / f"{self.round}.{r}.json"
            while True:
                try:
                    out.append(json.loads(p.read_text()))
                    break
                except FileNotFoundError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"FileExchange round {self.round}: rank {r} did not publish {p} "
                                       f"within {self.timeout_s} s")
                time.sleep(0.002)
        # Every rank published this round, so every rank has read the previous one: ours can go.
        if self.round > 1:
            with contextlib.suppress(OSError):
                os.unlink(self.session / f"{self.round - 1}.{self.rank}.json")
        return out

    def close(self, timeout_s: Optional[float] = None) -> None:
        """End the session (idempotent): every rank marks itself done; rank 0 withdraws
        ``session.json`` (no rank joins the session any more), waits (up to ``timeout_s``, default the
        exchange's) until every rank that joined the session marked itself done, then removes the
        session folder, in every case: a rank that never joined is not waited for (a setup that failed
        or was interrupted before every rank arrived), and a joined rank still inside when the wait
        ends cannot complete a round without rank 0 anyway (its next round raises)."""
        if timeout_s is not None:
            _check_seconds("timeout_s", timeout_s)
        if self._closed:
            return
        self._closed = True
        session = self.session
        if session is None:
            return
        with contextlib.suppress(OSError):
            _write_private(session / f"done.{self.rank}", "")
        if self.rank != 0:
            return
        with contextlib.suppress(OSError, ValueError):
            if json.loads((self.dir / self.SESSION_FILE).read_text()).get("nonce") == session.name[2:]:
                os.unlink(self.dir / self.SESSION_FILE)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

        def done():
            # Rank r took its seat (join.r) before it could publish anything in the session.
            return all((session / f"done.{r}").exists() for r in range(1, self.world_size)
                       if (session / f"join.{r}").exists())

        while not done() and time.monotonic() <= deadline:
            time.sleep(0.002)
        # Renamed first, so that a rank taking its seat right now cannot add a file to the folder while
        # it is being removed (which would leave it behind); its join then finds no session.
        gone = session.with_name(f".{session.name}.gone")
        try:
            os.rename(session, gone)
        except OSError:
            gone = session
        shutil.rmtree(gone, ignore_errors=True)

    def __enter__(self) -> "FileExchange":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_group(group: Any) -> None:
    """ValueError unless ``group`` is None or a torch.distributed process group: anything else failed
    only inside torch.distributed, on the first exchange, with an AttributeError."""
    import torch.distributed as dist

    pg = getattr(dist, "ProcessGroup", None)
    _check(group is None or (pg is not None and isinstance(group, pg)),
           f"group must be a torch.distributed ProcessGroup (this TP group) or None, got {type(group).__name__}")


#: The largest exchanged object (as JSON) of a group exchange: what Transport exchanges is a few hundred
#: bytes (pids, names, geometry); every rank sends a record of this size.
GROUP_RECORD_BYTES = 16384


def group_exchange(group=None) -> Callable[[Any], List[Any]]:
    """All-gather through a torch.distributed group (gloo is enough).

    Each object travels as JSON (as :class:`FileExchange` writes it) in a fixed-size byte record
    (``GROUP_RECORD_BYTES``, one all-gather), so nothing a peer sends is unpickled.

    Arguments:
        group: the TP group, its group rank r being TP rank r (None: WORLD).

    Returns:
        ``exchange(obj) -> [obj of group rank 0, obj of group rank 1, ...]``, as ``Transport`` takes it.

    Raises:
        ValueError (from the returned function): an object that is not JSON or longer than the record.
    """
    import torch
    import torch.distributed as dist

    _check_group(group)

    def _exchange(obj):
        text = json.dumps(obj).encode()
        _check(len(text) + 4 <= GROUP_RECORD_BYTES,
               f"exchange: the object takes {len(text)} bytes as JSON, the record holds {GROUP_RECORD_BYTES - 4}")
        record = torch.zeros(GROUP_RECORD_BYTES, dtype=torch.uint8)
        record[:4] = torch.tensor(list(len(text).to_bytes(4, "little")), dtype=torch.uint8)
        record[4:4 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
        if dist.get_backend(group) != "gloo":
            record = record.cuda()
        every = [torch.empty_like(record) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, record, group=group)
        out = []
        for r, got in enumerate(every):
            raw = bytes(got.cpu().tolist())
            n = int.from_bytes(raw[:4], "little")
            _check(n <= GROUP_RECORD_BYTES - 4, f"exchange: group rank {r} sent a record claiming {n} bytes")
            out.append(json.loads(raw[4:4 + n].decode()))
        return out

    return _exchange


def _check_same_geometry(rank: int, geometries: Sequence[dict]) -> None:
    """Every rank must pass rank 0's expert_nbytes, num_experts and num_slots: rank 0 writes each
    rank's slots at its own offsets and each consumer copies at its own, so a disagreement would
    deliver wrong bytes silently. Checked on the first exchange, so every rank raises at once
    (ValueError) and nothing has been created yet."""
    want = geometries[0]
    bad = [r for r, g in enumerate(geometries) if g != want]
    if not bad:
        return

    def fmt(g):
        return f"expert_nbytes {g['expert_nbytes']}, num_experts {g['num_experts']}, num_slots {g['num_slots']}"

    if rank in bad:
        head = f"rank {rank} was given {fmt(geometries[rank])} but rank 0 was given {fmt(want)}"
    else:
        head = ("; ".join(f"rank {r} was given {fmt(geometries[r])}" for r in bad)
                + f", but rank 0 was given {fmt(want)}")
    raise ValueError(f"{head}: every rank must pass the same expert_nbytes, num_experts and num_slots")


def _tell_peers_and_raise(err: Exception, rank: Any, tp_size: Any, exchange: Any, group: Any) -> None:
    """Raises ``err`` (a bad constructor argument, or a backend this process cannot use) after
    offering the peers an error record in the first exchange, where they would otherwise wait for
    this rank until the exchange's own timeout. Best effort: with an unusable exchange (itself the bad
    argument, or no process group) the error is raised as it is. A FileExchange is closed afterwards,
    as a Transport closes it once its setup is over, so that its session folder does not stay. A
    FileExchange of another world size than a valid tp_size is not used: its round would wait for
    ranks that are not there (until its timeout) or gather ranks of another group."""
    try:
        fits = not isinstance(exchange, FileExchange) or _int_arg("tp_size", tp_size, 1, MAX_TP) == exchange.world_size
    except ValueError:
        fits = True  # tp_size is the bad argument: the exchange may well be the right one
    if not fits:
        raise err
    try:
        if exchange is None:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                raise err
            exchange = group_exchange(group)
        if callable(exchange):
            exchange({"error": f"rank {rank!r}: {err}"})
    except Exception:  # noqa: BLE001 - the peers then time out as before; this rank's error stands
        pass
    if isinstance(exchange, FileExchange):
        with contextlib.suppress(Exception):
            exchange.close(timeout_s=min(exchange.timeout_s, 2.0))
    raise err


def _check_exchange_group(rank: int, tp_size: int, hello: Sequence[Any]) -> None:
    """The exchange must be an all-gather over exactly this TP group, in TP-rank order: entry r from
    TP rank r. A group spanning more processes (the default group=None is WORLD, e.g. in a TP2 x DP2
    job) or ordered differently (group rank != TP rank) would attach rank r to another rank's
    segments. Every rank sees the same entries, so every rank raises ValueError here, before
    anything is created."""
    def tp_of(h):
        return (h.get("tp_rank"), h.get("tp_size")) if isinstance(h, dict) else (None, None)

    got = [tp_of(h) for h in hello] if isinstance(hello, (list, tuple)) else None
    hint = ("pass group=<a torch.distributed group of exactly this TP group's ranks, in TP-rank order> "
            "(the default group=None is WORLD) or an exchange over them")
    _check(got is not None, f"rank {rank}: the exchange returned {type(hello).__name__}, not a list; {hint}")
    sizes = sorted({s for _, s in got if s is not None})
    _check(all(s == tp_size for s in sizes),
           f"rank {rank}: the exchange's ranks disagree on tp_size (got {sizes}): {hint}")
    _check(len(got) == tp_size,
           f"rank {rank}: the exchange returned {len(got)} entries (from TP ranks {[r for r, _ in got]}) but tp_size "
           f"is {tp_size}: it must gather exactly the tp_size ranks of this TP group; {hint}")
    bad = [(i, r) for i, (r, _) in enumerate(got) if r != i]
    _check(not bad, f"rank {rank}: the exchange's entry {bad[0][0] if bad else 0} came from TP rank "
                    f"{bad[0][1] if bad else 0} (entries from TP ranks {[r for r, _ in got]}): entry r must come from "
                    f"TP rank r (group rank == TP rank); {hint}")
    lacking = [i for i, h in enumerate(hello) if "geometry" not in h or "pid" not in h]
    if lacking:
        i = lacking[0]
        raise ValueError(f"rank {rank}: the exchange's entry {i} lacks what TP rank {i} passed to it (got "
                         f"{hello[i]!r}): the exchange must return every rank's object unchanged")
