"""``solar ingest INPUT... -o OUT.h5``: build a (compressed) SOLAR HDF5 file, in parallel under mpirun.

Examples::

    solar ingest data/*.npy -o train.h5                       # serial, one field "x"
    solar ingest x=X.npy y=Y.npy -o train.h5                  # two fields from separate files
    mpirun -n 8 solar ingest run1.h5 run2.h5 -o train.h5 --rel-error 1e-3 --verify
    mpirun -n 8 solar ingest ... -o train.h5 --resume         # after a crash: continue

Exit codes: 0 done, 2 bad input or options (nothing written; also an input that changed while the
run read it, or that a read found unusable: no OUT; and a rerun without --resume or --overwrite
that finds OUT.tmp with committed batches: they are kept), 3 verification failed, 4 storage or
I/O failure during the run (an input server died, stalled or refused a read, the output's disk is
full; ``--resume`` continues from the last committed batch), 1 other. Under mpirun the same codes
are the job's: a rank that fails alone prints its message and ends the job with ``MPI_Abort`` of
that code (mpirun returns it, after its MPI_ABORT banner).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from solar.dist import mpi_comm
from solar.errors import (ConfigError, CorruptDataError, DatasetFormatError, InputError, MissingDependencyError,
                          MPIUnavailableError)
from solar.ingest import EXIT_INPUT, EXIT_STORAGE, JOURNAL_SUFFIX, TMP_SUFFIX, failure_lines, ingest
from solar.ingest.journal import read_journal

__all__ = ["configure", "run"]


def configure(p) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help=".npy/.npz files or HDF5 files (FILE.h5 or FILE.h5:/dataset), local paths or fsspec URLs; "
                        "NAME=FILE (x=X.npy y=Y.npy) takes each field from its own files")
    p.add_argument("-o", "--output", required=True, help="the SOLAR HDF5 file to write")
    p.add_argument("--fields", nargs="+", metavar="NAME[=KEY]",
                   help="fields to keep, in order; NAME=KEY renames; for .npy inputs the field name (default x)")
    bound = p.add_mutually_exclusive_group()
    bound.add_argument("--abs-error", type=float,
                       help="compress float fields within this absolute error (a field whose sample is no "
                            "larger than the codec's blob header, e.g. one float per sample, is stored raw; "
                            "stderr says which)")
    bound.add_argument("--rel-error", type=float,
                       help="compress float fields within REL x (max - min) of each field's values (tiny "
                            "samples stored raw, as for --abs-error)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run from its last committed batch (an OUT this same job "
                        "finished is reported complete; any other existing OUT still needs --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it exists (atomically, at the end), and start over even when OUT.tmp holds "
                        "batches an interrupted run committed (without --resume or --overwrite such a run is refused)")
    p.add_argument("--verify", action="store_true",
                   help="read everything back before the rename: checksums, and values within the bound")
    p.add_argument("--batch-size", type=int, default=256, help="samples written per collective step (default 256)")
    p.add_argument("--commit-interval", type=float, default=2.0,
                   help="seconds between commits (flush + journal) that --resume restarts from "
                        "(default 2; 0: every batch)")
    p.add_argument("--samples", choices=("auto", "file", "axis0"), default="auto",
                   help="file: each .npy/.npz file is one sample; axis0: arrays have a leading sample axis; "
                        "auto (default): file when several inputs all have the same shape (stderr says so)")
    p.add_argument("--storage-options", type=json.loads, default=None, metavar="JSON",
                   help='fsspec options for input URLs, e.g. \'{"anon": true}\'')
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the report as JSON (rank 0)")


def run(args) -> int:
    comm = mpi_comm()
    rank = comm.rank if comm is not None else 0
    t0 = time.time()
    try:
        rep = ingest(args.inputs, args.output, fields=args.fields, abs_error=args.abs_error,
                     rel_error=args.rel_error, resume=args.resume, overwrite=args.overwrite, verify=args.verify,
                     batch_size=args.batch_size, samples=args.samples, progress=not args.no_progress,
                     storage_options=args.storage_options, commit_interval=args.commit_interval)
    except (InputError, ConfigError, MissingDependencyError, MPIUnavailableError) as exc:  # raised on every rank alike
        if rank == 0:
            print(f"solar ingest: {exc}", file=sys.stderr)
        return 2
    except CorruptDataError as exc:
        if rank == 0:
            print(f"solar ingest: verification failed: {exc}", file=sys.stderr)
        return 3
    except DatasetFormatError as exc:
        # An input whose layout a read finds unusable after the checks (a virtual HDF5 dataset
        # over fsspec ...): bad input, one line naming it, not a traceback. Possibly raised on
        # this rank alone: under MPI it says so and ends the job with the same code.
        parallel = comm is not None and comm.size > 1
        print(f"solar ingest: {f'rank {rank}: ' if parallel else ''}{exc}", file=sys.stderr, flush=True)
        if parallel:
            comm.Abort(EXIT_INPUT)
        return EXIT_INPUT
    except OSError as exc:
        # Storage failed mid-run (StorageError: a server died, refused or ignored a Range request,
        # the disk is full; or another OSError of a read or write): one line, not a traceback,
        # and how to go on. Possibly raised on this rank alone: under MPI it says so and ends the
        # job. (A failure inside the write loop under MPI is reported by ingest() itself, with
        # the same lines, since the other ranks wait in a collective call: failure_lines.)
        parallel = comm is not None and comm.size > 1
        if rank == 0 or parallel:
            out = args.output[len("file://"):] if args.output.startswith("file://") else args.output
            for line in failure_lines(exc, out + TMP_SUFFIX, _committed_batches(args, t0), rank if parallel else None):
                print(f"solar ingest: {line}", file=sys.stderr, flush=True)
        if parallel:
            comm.Abort(EXIT_STORAGE)
        return EXIT_STORAGE
    except BaseException as exc:
        # One rank failing alone would leave the others blocked in a collective call: end the job.
        if comm is not None and comm.size > 1 and not isinstance(exc, KeyboardInterrupt):
            traceback.print_exc()
            print(f"solar ingest: rank {rank} failed; aborting the MPI job ({OUT_SAFE})", file=sys.stderr)
            comm.Abort(1)
        raise
    if rank == 0:
        if args.json:
            print(json.dumps({**rep.__dict__, "ratio": rep.ratio}))
        elif rep.already_complete:
            print(f"{rep.output} is already complete (written by this same job: same inputs and options); "
                  f"nothing to do{', verified' if rep.verified else ''}")
        else:
            resumed = f", resumed at batch {rep.resumed_from_batch}" if rep.resumed_from_batch else ""
            ratio = f" (x{rep.ratio:.2f})" if rep.input_bytes else ""  # no ratio of nothing (0 samples)
            print(f"wrote {rep.output}: {rep.num_samples} samples, fields {', '.join(rep.fields)}, "
                  f"{rep.input_bytes / 1e6:.1f} MB in -> {rep.stored_bytes / 1e6:.1f} MB stored"
                  f"{ratio}, {rep.seconds:.1f} s on {rep.world_size} rank(s)"
                  f"{resumed}{', verified' if rep.verified else ''}")
    return 0


OUT_SAFE = "the output was not created; rerun with --resume to continue"


def _committed_batches(args, t0: float) -> int:
    """How many batches ``--resume`` would keep after a failed run: those of ``OUT.tmp``'s
    journal (NOTE [ Ingest crash safety ] in ``solar/ingest/__init__.py``); 0 when there is nothing to
    continue. A journal older than this run belongs to an earlier one, unless this run was a
    ``--resume``."""
    out = args.output[len("file://"):] if args.output.startswith("file://") else args.output
    tmp, journal = out + TMP_SUFFIX, out + JOURNAL_SUFFIX
    rec = read_journal(journal)
    try:
        fresh = args.resume or os.stat(journal).st_mtime >= t0 - 1
    except OSError:
        return 0
    if not rec or not fresh or not os.path.exists(tmp):
        return 0
    return int(rec.get("batches_done") or 0)
