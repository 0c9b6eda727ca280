"""A job root: one checkpoint root shared by every rank of a job, committed one version at a time.

Layout (beside the chunk store of :mod:`.store`, whose ``chunks/`` every rank shares)::

    JOB                              marker: the root belongs to a job writer (JSON: format, world size)
    parts/<step, 20 digits>/<rank>   one manifest part per rank: a solar-ckpt/1 manifest of that rank's state
                                     (``<rank>.<gen>``: the part rewritten by a repack, :mod:`.repack`)
    versions/<step, 20 digits>       the global manifest, written LAST, by rank 0 only

A version exists if and only if its global manifest exists and verifies: the global manifest lists
every rank's part with the xxh3-128 of its bytes, so a part that is missing, torn or replaced by a
later (uncommitted) save makes that version fail to load instead of mixing two saves. Parts without
a global manifest are the leftovers of a save that did not commit; ``gc`` removes them.

Global manifest (``solar-ckpt-job/1``), little-endian, sealed like a part (:func:`.manifest.seal`)::

    JOB_MAGIC (16 B) | header length (u64) | JSON header | xxh3-128 of all before (16 B) | END (8 B)

The header's ``features`` lists the extensions a reader must understand to load the version:
``deltas`` when any rank's part stores chunks as deltas (:mod:`.delta`; such a part is
``solar-ckpt/2`` and its entry says ``deltas: true``). A reader refuses a version naming a feature
it does not know, rather than misreading it.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import asdict, dataclass, field

import xxhash

from solar.errors import CheckpointError, CorruptDataError

from .manifest import Manifest, decode, seal, unseal
from .store import CheckpointStore, referenced

__all__ = ["JOB_FORMAT", "JobManifest", "PartEntry", "JobStore", "is_job_root", "encode_job", "decode_job"]

JOB_FORMAT = "solar-ckpt-job/1"
JOB_MAGIC = b"SOLAR-CKPT-JOB\x00\x01"
assert len(JOB_MAGIC) == 16
MARKER = "JOB"
_VERSIONS = "versions/"
_PARTS = "parts/"
#: extensions this SOLAR reads (a version naming another is refused, not misread)
KNOWN_FEATURES: frozenset[str] = frozenset({"deltas"})


@dataclass
class PartEntry:
    """One rank's manifest part as the global manifest pins it."""

    rank: int
    nbytes: int
    digest: str  # hex xxh3-128 of the part's encoded bytes
    root: str  # the part's Merkle root (hex)
    gen: int = 0  # which key holds the part: 0 as saved, then one more per rewrite by a repack
    deltas: bool = False  # the part stores chunks as deltas (the version then names the feature)


def _entry(p: PartEntry) -> dict:
    """A part's entry as the global manifest stores it (``gen`` only when nonzero, ``deltas`` only
    when true: the manifests of versions without them keep their exact bytes)."""
    out = asdict(p)
    if not p.gen:
        del out["gen"]
    if not p.deltas:
        del out["deltas"]
    return out


@dataclass
class JobManifest:
    step: int
    world_size: int
    hash: str
    chunk_size: int
    parts: list[PartEntry]
    root: str = ""  # hex digest over the parts' roots, in rank order
    created: float = 0.0
    parent: int | None = None
    features: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def encode_job(m: JobManifest) -> bytes:
    header = {"format": JOB_FORMAT, **asdict(m), "parts": [_entry(p) for p in m.parts]}
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    return seal(b"".join([JOB_MAGIC, struct.pack("<Q", len(head)), head]))


def decode_job(data: bytes, where: str = "global manifest") -> JobManifest:
    """Parse and check a global manifest.

    Raises:
        CorruptDataError: torn, altered or malformed (names ``where``).
    """
    body = unseal(data, JOB_MAGIC, where)
    (hlen,) = struct.unpack_from("<Q", body, 16)
    try:
        h = json.loads(bytes(body[24:24 + hlen]))
        if not isinstance(h, dict) or h.pop("format", None) != JOB_FORMAT:
            raise ValueError(f"format is not {JOB_FORMAT}")
        h["parts"] = [PartEntry(**p) for p in h["parts"]]
        m = JobManifest(**h)
        ok = (isinstance(m.step, int) and m.step >= 0 and isinstance(m.world_size, int)
              and [p.rank for p in m.parts] == list(range(m.world_size))
              and all(isinstance(p.gen, int) and p.gen >= 0 and isinstance(p.deltas, bool) for p in m.parts))
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise CorruptDataError(f"{where} has an unreadable header: {exc}") from exc
    if not ok:
        raise CorruptDataError(f"{where} is invalid: its parts are not one per rank 0 .. world_size - 1")
    return m


def part_digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def is_job_root(store: CheckpointStore) -> bool:
    """Whether a job writer made this root (its marker exists)."""
    return store.tier.exists(MARKER)


class JobStore:
    """The global manifests and parts of a job root, over its :class:`CheckpointStore`."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.root = store.root
        self._refs: dict[tuple[int, int, str], set[bytes]] = {}  # (step, rank, part digest) -> chunks

    # -- keys --
    @staticmethod
    def version_key(step: int) -> str:
        return f"{_VERSIONS}{int(step):020d}"

    @staticmethod
    def part_key(step: int, rank: int, gen: int = 0) -> str:
        key = f"{_PARTS}{int(step):020d}/{int(rank):06d}"
        return f"{key}.{int(gen)}" if gen else key

    # -- marker --
    def marker(self) -> dict | None:
        data = self.store.tier.get(MARKER)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError as exc:
            raise CorruptDataError(f"job marker {self.root}/{MARKER} is unreadable ({exc})") from exc

    def write_marker(self, world_size: int) -> None:
        body = {"format": JOB_FORMAT, "world_size": world_size, "created": time.time()}
        self.store.tier.put(MARKER, json.dumps(body).encode())

    # -- parts --
    def put_part(self, m: Manifest, rank: int, data: bytes, gen: int = 0) -> None:
        if not self.store.tier.put(self.part_key(m.step, rank, gen), data):
            raise CheckpointError(f"checkpoint root {self.root} is over its byte budget writing rank {rank}'s part of "
                                  f"step {m.step}; earlier versions are intact")

    def delete_part(self, step: int, rank: int, gen: int | None = None) -> None:
        """Delete rank ``rank``'s part of ``step``: generation ``gen``, or every one (``None``)."""
        if gen is not None:
            self.store.tier.delete(self.part_key(step, rank, gen))
            return
        for g in self.part_gens(step).get(rank, []):
            self.store.tier.delete(self.part_key(step, rank, g))

    def part_gens(self, step: int) -> dict[int, list[int]]:
        """The stored parts of ``step``: rank -> generations."""
        out: dict[int, list[int]] = {}
        for key in self.store.tier.keys_with_prefix(f"{_PARTS}{int(step):020d}/"):
            rank, _dot, gen = str(key).rpartition("/")[2].partition(".")
            if rank.isdigit() and (gen.isdigit() or not gen):
                out.setdefault(int(rank), []).append(int(gen or 0))
        return out

    def part_steps(self) -> dict[int, list[int]]:
        """Every stored part: step -> ranks (committed or not; a rank once, whatever its generations)."""
        out: dict[int, list[int]] = {}
        for key in self.store.tier.keys_with_prefix(_PARTS):
            bits = str(key).split("/")
            rank = bits[2].partition(".")[0] if len(bits) == 3 else ""
            if len(bits) == 3 and bits[1].isdigit() and rank.isdigit() and int(rank) not in out.get(int(bits[1]), []):
                out.setdefault(int(bits[1]), []).append(int(rank))
        return out

    def part(self, jm: JobManifest, rank: int) -> Manifest:
        """Rank ``rank``'s part of version ``jm``, checked against the digest the global manifest pins.

        Raises:
            CheckpointError: no such rank in the version.
            CorruptDataError: the part is missing, torn or not the one committed.
        """
        if not 0 <= rank < jm.world_size:
            raise CheckpointError(f"step {jm.step} of {self.root} was saved by {jm.world_size} ranks; there is no "
                                  f"rank {rank} (load it with a rank in 0 .. {jm.world_size - 1})")
        where = f"rank {rank}'s part of step {jm.step} in {self.root}"
        entry = jm.parts[rank]
        data = self.store.tier.get(self.part_key(jm.step, rank, entry.gen))
        if data is None:
            raise CorruptDataError(f"{where} is missing, but the global manifest lists it; the root is damaged: load "
                                   "an older version, and run `solar-ckpt verify` on it")
        if len(data) != entry.nbytes or part_digest(data) != entry.digest:
            raise CorruptDataError(f"{where} is not the part its global manifest committed (its bytes changed); "
                                   "the root is damaged: load an older version")
        return decode(data, where)

    def referenced(self, jm: JobManifest) -> set[bytes]:
        """Every chunk the version's parts reference (each part read once, then remembered)."""
        out: set[bytes] = set()
        for p in jm.parts:
            key = (jm.step, p.rank, p.digest)
            if key not in self._refs:
                self._refs[key] = referenced([self.part(jm, p.rank)])
            out |= self._refs[key]
        return out

    def forget(self, steps: "set[int] | list[int]") -> None:
        """Drop what :meth:`referenced` remembers of removed versions (a long run keeps few)."""
        gone = set(steps)
        self._refs = {k: v for k, v in self._refs.items() if k[0] not in gone}

    # -- global manifests --
    def steps(self) -> list[int]:
        out = []
        for key in self.store.tier.keys_with_prefix(_VERSIONS):
            name = str(key).rpartition("/")[2]
            if name.isdigit():
                out.append(int(name))
        return sorted(out)

    def put_global(self, jm: JobManifest) -> int:
        data = encode_job(jm)
        if not self.store.tier.put(self.version_key(jm.step), data):
            raise CheckpointError(f"checkpoint root {self.root} is over its byte budget committing step {jm.step}; "
                                  "earlier versions are intact")
        return len(data)

    def find_global(self, step: int) -> JobManifest | None:
        data = self.store.tier.get(self.version_key(step))
        if data is None:
            return None
        jm = decode_job(data, f"global manifest of step {step} in {self.root}")
        unknown = set(jm.features) - KNOWN_FEATURES
        if unknown:
            raise CorruptDataError(f"step {step} of {self.root} uses {sorted(unknown)}, which this SOLAR cannot read; "
                                   "upgrade SOLAR to load it")
        return jm

    def read_global(self, step: int) -> JobManifest:
        jm = self.find_global(step)
        if jm is None:
            raise CheckpointError(f"no checkpoint step {step} in job root {self.root}; versions: "
                                  f"{self.versions() or 'none'}")
        return jm

    def delete_global(self, step: int) -> None:
        self.store.tier.delete(self.version_key(step))

    def valid(self) -> list[JobManifest]:
        """The global manifests that verify, oldest first (damaged ones are skipped)."""
        out = []
        for s in self.steps():
            try:
                jm = self.find_global(s)
            except CorruptDataError:
                continue
            if jm is not None:
                out.append(jm)
        return out

    def versions(self) -> list[int]:
        return [jm.step for jm in self.valid()]

    def latest(self) -> JobManifest | None:
        for s in reversed(self.steps()):
            try:
                jm = self.find_global(s)
            except CorruptDataError:
                continue
            if jm is not None:
                return jm
        return None

    def resolve(self, step: int | None) -> JobManifest:
        if step is not None:
            return self.read_global(step)
        jm = self.latest()
        if jm is None:
            raise CheckpointError(f"no complete checkpoint in job root {self.root}; nothing to load")
        return jm

