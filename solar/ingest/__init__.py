"""``solar ingest``: build one SOLAR HDF5 file (``solar-h5/1``) from many inputs, in parallel.

Under ``mpirun -n P`` every rank converts (and compresses) its share of each batch and writes it
into the same file through parallel HDF5 with collective I/O; without mpirun the same code runs
serially and writes a byte-identical data layout. See ``docs/storage.md`` for the file layout.

NOTE [ Ingest phases ]
    1. validate (rank 0): every input is opened and described; a missing file, a field whose
       sample shape/dtype differs between inputs, an output that already exists, ... stop the job
       *before anything is written*, on every rank (the verdict is broadcast). Rank 0 also decides
       which float fields a bound compresses: one whose samples are no larger than the codec's
       smallest blob stays raw (``plan._keep_tiny_fields_raw``; by shape and dtype only).
    2. bound pass (only for ``--rel-error`` or a codec that cannot keep NaN): every rank scans its
       share; min/max are all-reduced so the relative bound means the same for every sample of a
       field (it is relative to the **field's** value range, max - min over all its samples).
    3. write: the samples are cut into global batches of ``batch_size``; each batch is split
       evenly across ranks. Raw rows are written with one collective hyperslab write per field;
       compressed samples are encoded, each rank's bytes placed after the lower ranks' (an
       exscan of their totals), the ``data`` dataset grown collectively and every rank writes
       its bytes at its offset. Each rank holds the inputs of its rows only (rank 0 scatters
       them: ``plan.scatter_plan``); rank 0, which validated every input, keeps them all.
    4. commit (after the batch that ends a ``commit_interval``, and the last one): a collective
       flush, then rank 0 replaces the journal (``OUT.ingest.json``) naming the batches done.
       See NOTE [ Ingest crash safety ].
    5. finish: offsets end, codec attributes; rank 0 alone then writes the provenance (it lists
       every input) and ``complete=True``; ``--verify`` re-reads every sample
       (checksums; decoded values against the inputs within the bound, raw ones exactly); rank 0
       takes the inputs' identities again, and a changed input stops the job on every rank
       (``journal.check_inputs_unchanged``); then the rename.

NOTE [ Ingest crash safety ]
    Everything is written to ``OUT.tmp``; ``OUT`` appears only by ``os.replace`` after the file is
    complete (and verified when asked). If any rank dies (SIGKILL), ``OUT`` is untouched.
    ``--resume`` reopens ``OUT.tmp``, checks the journal's fingerprint (inputs with their size,
    mtime and a digest of a sample of their bytes, fields, bounds, batch size) and continues
    after the last committed batch, rewriting anything a dead batch left half-written; a changed
    input (the journal names it) starts the run over. The world size may differ between the
    runs: a batch is a global unit (a file a serial run started is restarted under mpirun:
    parallel HDF5 cannot grow its chunked datasets). Under mpirun, an error on one rank inside
    the write loop aborts the job with its message (the others would wait in the next collective
    write); committed batches stay. A storage failure (disk full, an input server gone) prints
    the lines the serial run prints (what failed, which file, the ``--resume`` hint) and aborts
    with ``EXIT_STORAGE`` (4), which mpirun returns as the job's exit code.
    If ``OUT.tmp`` cannot be opened any more, the run starts over. Serially, ``OUT.tmp`` is
    fsynced before the rename (under MPI the collective flush is an ``MPI_File_sync``) and the
    directory after it. A finished ``OUT`` is only ever replaced with ``--overwrite``: ``--resume``
    reports one with this job's fingerprint (provenance) as already complete and writes nothing,
    and refuses one written by a different job (or not by ``solar ingest``). Committed batches
    are only ever discarded with ``--overwrite``: a run without ``--resume`` or ``--overwrite``
    that finds ``OUT.tmp`` with committed batches in its journal stops before writing anything
    and says how to go on (``journal.refuse_to_discard``). One run writes an output at a time
    (``OUT.ingest.lock``, ``journal.OutputLock``).

The package follows those phases:

    ``plan.py``      the :class:`Plan` and its fields, validation (phase 1), the bound pass (phase 2)
    ``sources.py``   the inputs: ``.npy``/``.npz``/HDF5, local or fsspec URLs
    ``write.py``     :func:`ingest`, ``OUT.tmp``'s datasets and collective writes (phases 3 to 5)
    ``journal.py``   the journal, resume point, finished outputs, output lock, redacted provenance
    ``failures.py``  storage failures as one :class:`StorageError`; ending an MPI job after one
    ``verify.py``    :func:`verify_file` (``--verify``)

Each module imports only modules named before it in: ``failures``, ``sources``, ``journal``, ``plan``,
``verify``, ``write`` (no cycle).
"""

from __future__ import annotations

# Beyond __all__, solar.ingest also offers the names the CLI and callers use: exit codes, file
# suffixes, failure messages, the plan's classes and the provenance helpers.
from solar.ingest.failures import EXIT_INPUT, EXIT_STORAGE, failure_lines, resume_hint, storage_error  # noqa: F401
from solar.ingest.journal import JOURNAL_SUFFIX, LOCK_SUFFIX, TMP_SUFFIX, redact_argv, redact_url  # noqa: F401
from solar.ingest.plan import FINGERPRINT_PREFIX, FieldPlan, Plan  # noqa: F401
from solar.ingest.verify import verify_file
from solar.ingest.write import DATA_CHUNK, IngestReport, ingest  # noqa: F401

__all__ = ["ingest", "IngestReport", "verify_file"]

