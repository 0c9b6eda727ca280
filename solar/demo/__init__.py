"""``solar demo`` (``make demo``): the whole product in a few minutes.

1. Data (:mod:`solar.demo.data`): a PtychoNN-like training set whose target is a function of its
   input (``solar.synthetic.ptycho_posed_block``: ``--samples`` of 1xSxS diffraction -> 2xSxS
   amplitude and phase) and a held-out validation set, written as .npy and ingested with
   ``mpirun -n 2 solar ingest x=X.npy y=Y.npy`` into a raw SOLAR file and one compressed file per
   ``--bounds``; the raw training set's statistics normalize the surrogate's input and output.
2. Training (:mod:`solar.demo.train`, the surrogate in :mod:`solar.demo.model`), each run a separate
   ``mpirun -n 2`` (:mod:`solar.demo.runs`), on storage throttled to a parallel-file-system share
   (``--bandwidth`` per rank, ``--latency`` per request): torch's DataLoader and SOLAR on the raw
   file, SOLAR on every compressed file, more seeds of the raw run.
3. Checkpoints: the raw SOLAR run saves a job-wide checkpoint (model, optimizer, loader) every
   ``--ckpt-every`` steps; the same run is killed mid-epoch (SIGKILL of a rank) and resumed from its
   last version, and its losses are compared with the uninterrupted run's; ``solar-ckpt log`` and
   ``diff`` of two versions.
4. The report (:mod:`solar.demo.report`): the loader table, the validation loss per bound against
   the raw run's seed-to-seed spread and the mean predictor's, and ``OUT/report.png`` (five panels;
   ``OUT/report.json`` beside it).

:mod:`solar.demo.steps` runs the four; ``solar/cli/demo.py`` parses the options. Without mpirun
or MPI-enabled h5py every step runs in one process, and the demo says so.
"""
