"""What ``--resume`` knows: the journal (``OUT.ingest.json``), the fingerprints of finished
outputs, the resume point, the output lock (``OUT.ingest.lock``) and the redacted provenance.

The job's fingerprint itself is :meth:`solar.ingest.plan.Plan.fingerprint`; here it is only
compared. See NOTE [ Ingest crash safety ] in :mod:`solar.ingest`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from solar.errors import InputError, StorageError
from solar.fileio import flock_or_holder
from solar.ingest.failures import one_line

__all__ = ["JOURNAL_SUFFIX", "TMP_SUFFIX", "LOCK_SUFFIX", "read_journal", "write_journal", "journal_record",
           "finished_fingerprint", "finished_by", "resume_point", "refuse_to_discard", "check_inputs_unchanged",
           "OutputLock", "redact_url", "redact_argv"]

JOURNAL_SUFFIX = ".ingest.json"
TMP_SUFFIX = ".tmp"
LOCK_SUFFIX = ".ingest.lock"


# -- the journal -----------------------------------------------------------------------------------
def write_journal(path: str, record: dict) -> None:
    """Replace the journal at ``path`` atomically (fsynced before the rename)."""
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(record, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_journal(path: str) -> dict | None:
    """The journal at ``path``, or None when it is missing or unreadable."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def journal_record(fp: str, ids: list[list] | None, batches_done: int, sizes: dict, out: str,
                   samples_done: int | None = None) -> dict:
    """The journal: what ``--resume`` continues (NOTE [ Ingest crash safety ]); ``inputs`` lets
    it name an input that changed since (:func:`_changed_inputs`); ``samples_done`` (the samples
    of the committed batches) lets a run that would discard them say how many
    (:func:`refuse_to_discard`)."""
    return {"fingerprint": fp, "batches_done": batches_done, "samples_done": samples_done, "data_bytes": sizes,
            "output": out, "inputs": ids}


# -- finished outputs and the resume point ---------------------------------------------------------
def finished_fingerprint(path: str) -> str | None:
    """The job fingerprint of ``path`` if it is a complete file written by ``solar ingest``, else None."""
    import h5py  # heavy; only an existing output is looked at

    try:
        with h5py.File(path, "r") as f:
            if not bool(f.attrs.get("complete", False)):
                return None
            fp = json.loads(f.attrs.get("provenance", "{}")).get("fingerprint")
            return fp if isinstance(fp, str) else None
    except (OSError, ValueError, AttributeError):
        return None


def finished_by(out: str, fp: str, legacy_fp: str) -> str:
    """Who finished the existing ``out``: ``"done"`` (this job; also when an older solar
    ingest finished it and its fingerprint matches this job's :meth:`Plan.legacy_fingerprint`,
    with a note, for the reasons given in :func:`resume_point`) or ``"other"``."""
    got = finished_fingerprint(out)
    if got == fp:
        return "done"
    if got == legacy_fp:
        print(f"solar ingest: {_legacy_note(f'{out} was finished', 'it is reported complete')}", file=sys.stderr)
        return "done"
    return "other"


def _legacy_note(subject: str, outcome: str) -> str:
    """What ``--resume`` says when it accepts a journal or output of a solar ingest that recorded
    the inputs by size and modification time only (see :func:`resume_point` for why it does)."""
    return (f"{subject} by an older solar ingest, which recorded the inputs by size and modification time only "
            f"(not a sample of their contents); they match, so {outcome}. If an input may have been rewritten "
            "since (e.g. copied back with cp -p or rsync -a), rerun with --overwrite instead; --verify compares "
            "every sample with the inputs before the output is created")


def resume_point(rec: dict | None, fp: str, legacy_fp: str, ids: list[list], journal: str,
                 tmp: str) -> tuple[int, dict | None, str | None]:
    """Where ``--resume`` continues: ``(batches_done, data_bytes or None, note for stderr)``.

    * the journal's fingerprint is this job's: continue after its committed batches;
    * it is this job's :meth:`Plan.legacy_fingerprint` (written by a solar ingest that did not
      sample input contents): continue too, with a note. Why not start over: the inputs match
      on everything that version recorded, so the user who upgraded between the crash and the
      resume keeps the guarantee the run was started with and does not lose its committed
      batches; the note says how to be sure (``--overwrite``, or ``--verify``, which compares
      every sample with the inputs before ``OUT`` is created). From the next commit on the
      journal carries the new fingerprint;
    * anything else is another job: start over, naming the inputs that changed when the
      journal recorded them (a regenerated input must never be mixed into its old rows)."""
    if not rec:
        return 0, None, None
    got = rec.get("fingerprint")
    if got in (fp, legacy_fp):
        if not os.path.exists(tmp):
            return 0, None, None
        done, kept = int(rec["batches_done"]), dict(rec["data_bytes"])
        if got == fp:
            return done, kept, None
        return done, kept, _legacy_note(f"{journal} was written", f"the run resumes at batch {done}")
    changed = _changed_inputs(rec.get("inputs"), ids)
    if changed:
        return 0, None, (f"cannot resume {tmp}: {'; '.join(changed)}; starting over, so that the output does not mix "
                         "rows of the old and the new input")
    return 0, None, f"{journal} belongs to a different job (inputs/options changed); starting over"


def _changed_inputs(old: Any, ids: list[list], when: str = "since that run") -> list[str]:
    """One phrase per input whose ``[url, size, stamp, digest]`` differs from the journal's
    record ``old`` (a journal of an older version has none: then nothing can be named);
    ``when`` says since when (``"since that run"``). A part that is unknown on either side
    (``None``: no metadata, unreadable bytes) is no evidence of a change."""
    if not isinstance(old, list):
        return []
    before = {o[0]: list(o[1:4]) for o in old if isinstance(o, list) and len(o) == 4}
    out = []
    for url, *now in ids:
        was = before.get(url)
        if was is None:
            continue
        differs = [a is not None and b is not None and a != b for a, b in zip(was, now)]
        if not any(differs):
            continue
        if any(differs[:2]):
            out.append(f"input {url} changed {when} (its size or modification time differs)")
        else:
            out.append(f"input {url} changed {when} (same size and modification time, other contents: "
                       "rewritten, e.g. regenerated and copied back with cp -p or rsync -a)")
    return out


def check_inputs_unchanged(plan, ids: list[list] | None, comm, tmp: str, journal: str) -> None:
    """Raise :class:`InputError` on every rank if an input's identity (rank 0's ``ids``, taken
    at the start of this run) differs now; rank 0 then removes ``tmp`` and ``journal``.

    Why: every read of a ``.npy`` input opens it anew, so an input regenerated while the run
    read it would give rows of both versions under a provenance fingerprint of the old one.
    ``tmp`` may mix both versions, so nothing of it is kept: without a journal ``--resume``
    starts over (as it would for the changed fingerprint; also should the input change back)."""
    changed, err = None, None
    if comm.rank == 0:
        try:
            changed = _changed_inputs(ids, plan.input_identities(), "while this run read it")
        except OSError as exc:  # e.g. an input deleted: OUT.tmp and the journal stay for --resume
            err = StorageError(f"checking that the inputs did not change while this run read them failed "
                               f"({one_line(exc)}), so {plan.output} was not created")
        if changed:
            for path in (tmp, journal):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
    changed, err = comm.bcast((changed, err), root=0)
    if err is not None:
        raise err
    if changed:
        raise InputError(f"{'; '.join(changed)}: the rows written may mix old and new contents, so "
                         f"{plan.output} was not created (and {tmp} was removed); run the job again once the "
                         "inputs stay unchanged (--resume starts over)")


def refuse_to_discard(out: str) -> None:
    """Raise :class:`InputError` when ``OUT.tmp`` holds batches that a run which did not finish
    committed (its journal says how many), naming them and how to go on; called by rank 0 for a
    run with neither ``--resume`` nor ``--overwrite``, which would otherwise recreate ``OUT.tmp``.

    Why: a rerun of the same command that only forgot ``--resume`` would throw away every
    committed batch (hours of work on a large ingest) without a word. ``OUT.tmp`` without a
    journal, or a journal with no committed batch, has nothing to keep: the run starts over."""
    tmp, journal = out + TMP_SUFFIX, out + JOURNAL_SUFFIX
    rec = read_journal(journal)
    if not isinstance(rec, dict) or not os.path.exists(tmp):
        return
    try:
        done = int(rec.get("batches_done") or 0)
    except (TypeError, ValueError):
        return
    if done <= 0:
        return
    samples = rec.get("samples_done")
    count = f"{done} committed batch(es)" + (f" ({samples} samples)" if isinstance(samples, int) else "")
    ids = rec.get("inputs")  # [[url, size, stamp, digest], ...]; absent from older journals
    urls = [str(i[0]) for i in ids if isinstance(i, list) and i] if isinstance(ids, list) else []
    inputs = ""
    if urls:
        shown = ", ".join(redact_url(u) for u in urls[:3])
        inputs = f" of {shown}" + (f" and {len(urls) - 3} more input(s)" if len(urls) > 3 else "")
    raise InputError(f"{tmp} holds {count}{inputs} from an earlier run that did not finish ({journal}); rerun "
                     "the same command with --resume to continue from there, or with --overwrite to discard them "
                     "and start over")


# -- one writer per output -------------------------------------------------------------------------
class OutputLock:
    """Rank 0's lock on ``OUT`` for the whole run: ``OUT.ingest.lock``, held with ``flock``.

    Why: of two runs to one output (a job resubmitted while the first still runs, two shells),
    the second would fail with HDF5's "unable to lock file" on ``OUT.tmp``, or, with
    ``HDF5_USE_FILE_LOCKING=FALSE`` (which HPC sites set for file systems without locks), write
    the first's ``OUT.tmp`` and journal too. The second run stops before it writes anything,
    naming the first. A crashed holder's lock goes with it (the kernel drops ``flock`` locks),
    so ``--resume`` never has a stale lock to clear; the file stays until the next run ends.
    Where the file system has no ``flock`` (Lustre mounted without it) or the lock file cannot
    be made, the run goes on unlocked: the lock guards against a mistake, it is not needed for
    a correct run.
    """

    def __init__(self, output: str) -> None:
        self.path = output + LOCK_SUFFIX
        self.fd: int | None = None

    def acquire(self) -> None:
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _attempt in range(5):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:
                return  # e.g. a read-only directory: writing OUT.tmp there reports it
            try:
                holder = flock_or_holder(fd, owner)
            except OSError:
                os.close(fd)
                return
            if holder is not None:
                raise InputError(f"{self.path[:-len(LOCK_SUFFIX)]} is being written by another solar ingest "
                                 f"({holder}); wait for it to finish, or write to another -o")
            try:  # the file locked must still be the one named (a finishing run removes it)
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # while still held: a run waiting on this inode sees it gone
            os.close(self.fd)
            self.fd = None


# -- provenance without credentials ----------------------------------------------------------------
def redact_url(url: str) -> str:
    """``url`` without credentials: user info and the query string (presigned URLs carry their
    signature there) are replaced by ``<redacted>``. Provenance goes into files meant to be shared."""
    try:
        u = urlsplit(url)
    except ValueError:
        return url
    if not u.scheme or u.scheme == "file":
        return url
    netloc = u.netloc if "@" not in u.netloc else "<redacted>@" + u.netloc.rpartition("@")[2]
    return urlunsplit((u.scheme, netloc, u.path, "<redacted>" if u.query else "", u.fragment))


def redact_argv(argv: list[str]) -> list[str]:
    """The command line as provenance may record it: ``--storage-options`` keeps its keys only
    (their values are credentials: S3 key and secret, tokens), URLs lose user info and queries."""
    out, hide = [], False
    for a in argv:
        if hide:
            out.append(_redact_options(a))
            hide = False
        elif a == "--storage-options":
            out.append(a)
            hide = True
        elif a.startswith("--storage-options="):
            out.append("--storage-options=" + _redact_options(a.partition("=")[2]))
        else:
            out.append(redact_url(a) if "://" in a else a)
    return out


def _redact_options(text: str) -> str:
    try:
        keys = list(json.loads(text))
    except (ValueError, TypeError):
        return "<redacted>"
    return json.dumps({str(k): "<redacted>" for k in keys})
