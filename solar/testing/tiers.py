"""Conformance suite every storage tier runs (shipped, so plug-in tiers can run it too).

Use it by subclassing :class:`TierTests` in a pytest module and providing a ``tier_cls`` fixture
that yields the class under test; the suite builds instances with ``tier_cls.example(dir, cap)``::

    @pytest.fixture(params=solar.cache.registry.names())
    def tier_cls(request):
        return solar.cache.get_tier(request.param)

    class TestMyTiers(TierTests):
        pass

The checks are what the loader and the checkpoint writer rely on: values round-trip byte-exact,
misses are ``None`` and counted, ``exists`` counts nothing, the byte budget is enforced without
storing anything, deletes and overwrites keep :attr:`~solar.cache.Tier.nbytes` exact, no temporary
ever shows up as a key, persistent tiers keep values across instances, and a tier that says it
keeps files (``keeps_files``, so the loader's ``spill=`` may name it) keeps them in its directory.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading

import numpy as np

from solar.errors import ConfigError

__all__ = ["TierTests", "race_put_new"]


def _fresh(tier_cls, capacity=None):
    return tier_cls.example(tempfile.mkdtemp(prefix="solar-tier-"), capacity)


def race_put_new(tier, rounds: int = 15, threads: int = 6, switch_interval: float | None = None) -> None:
    """``threads`` threads call ``tier.put_new`` on one fresh key at once, ``rounds`` times; exactly
    one must win each round, with its value stored and the byte count exact.

    ``switch_interval`` (seconds) makes Python switch threads that often during the race, which
    interleaves a check-then-write inside one process; leave it ``None`` when the storage's own
    server runs in this process (moto), whose conditional writes are not atomic under it.
    """
    old = sys.getswitchinterval()
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    try:
        for r in range(rounds):
            key, barrier, won = f"race{r}", threading.Barrier(threads), []

            def race(i: int) -> None:
                value = b"writer-%d" % i
                assert not tier.exists(key)
                barrier.wait()
                if tier.put_new(key, value):
                    won.append(value)

            workers = [threading.Thread(target=race, args=(i,)) for i in range(threads)]
            for t in workers:
                t.start()
            for t in workers:
                t.join()
            assert len(won) == 1 and tier.get(key) == won[0], f"round {r}: winners {won}"
        assert tier.nbytes == rounds * len(b"writer-0")
    finally:
        sys.setswitchinterval(old)


class TierTests:
    """Mix-in test class; needs a ``tier_cls`` fixture (a :class:`~solar.cache.Tier` subclass)."""

    def test_roundtrip_bytes_like(self, tier_cls, tmp_path):
        tier = tier_cls.example(str(tmp_path), None)
        values = {
            "a": b"hello",
            "dir/b": bytearray(b"\x00\x01" * 1000),
            "dir/sub/c": np.arange(1000, dtype=np.float32),
            "empty": b"",
        }
        for key, value in values.items():
            assert tier.put(key, value) is True
        for key, value in values.items():
            got = tier.get(key)
            assert got is not None, key
            assert bytes(memoryview(got).cast("B")) == bytes(memoryview(value).cast("B")), key
        assert sorted(tier.keys()) == sorted(values)
        assert tier.stats.hits == len(values)

    def test_miss_is_none_and_counted(self, tier_cls, tmp_path):
        tier = tier_cls.example(str(tmp_path), None)
        assert tier.get("nope") is None
        assert tier.stats.misses == 1 and tier.stats.hits == 0
        assert "nope" not in tier

    def test_exists_counts_nothing(self, tier_cls, tmp_path):
        tier = tier_cls.example(str(tmp_path), None)
        tier.put("k", b"v")
        before = tier.stats.as_dict()
        assert tier.exists("k") and not tier.exists("missing")
        assert tier.stats.as_dict() == before

    def test_delete_and_contains(self, tier_cls, tmp_path):
        tier = tier_cls.example(str(tmp_path), None)
        tier.put("x/y", b"123")
        assert "x/y" in tier
        assert tier.delete("x/y") is True
        assert "x/y" not in tier and tier.get("x/y") is None
        assert tier.delete("x/y") is False

    def test_nbytes_tracks_overwrite_and_delete(self, tier_cls, tmp_path):
        tier = tier_cls.example(str(tmp_path), None)
        tier.put("a", b"x" * 100)
        tier.put("b", b"y" * 50)
        assert tier.nbytes == 150
        tier.put("a", b"z" * 10)
        assert tier.nbytes == 60 and tier.get("a") == b"z" * 10
        tier.delete("b")
        assert tier.nbytes == 10
        tier.clear()
        assert tier.nbytes == 0 and len(tier) == 0

    def test_budget_rejects_without_storing(self, tier_cls, tmp_path):
        tier = tier_cls.example(str(tmp_path), 100)
        assert tier.put("a", b"x" * 60)
        assert tier.fits(40) and not tier.fits(41)
        assert tier.put("b", b"y" * 41) is False
        assert "b" not in tier and tier.nbytes == 60 and tier.stats.rejected == 1
        assert tier.put("a", b"x" * 100) is True  # an overwrite only needs the difference
        assert tier.nbytes == 100

    def test_put_new_stores_only_when_absent(self, tier_cls, tmp_path):
        tier = tier_cls.example(str(tmp_path), 100)
        assert tier.put_new("lock", b"first") is True
        assert tier.put_new("lock", b"second") is False
        assert tier.get("lock") == b"first" and tier.nbytes == 5
        assert tier.put_new("big", b"x" * 96) is False  # over the budget: refused, nothing stored
        assert "big" not in tier and tier.nbytes == 5
        tier.delete("lock")
        assert tier.put_new("lock", b"third") is True and tier.get("lock") == b"third"

    def test_put_new_race_has_one_winner(self, tier_cls, tmp_path):
        """Tiers that claim an exclusive create: of threads racing for one key, exactly one wins
        and its value is the one stored, even when every racer has seen the key absent first."""
        tier = tier_cls.example(str(tmp_path), None)
        if tier.exclusive_create:
            race_put_new(tier)

    def test_concurrent_puts_keep_the_budget_and_the_count(self, tier_cls, tmp_path):
        """Threads putting (different keys and one shared key) and deleting under a byte budget,
        switching every microsecond: ``nbytes`` never goes over the budget, always equals what
        is stored, and is 0 once every key is deleted (so puts of one key never leave the count
        high and refuse later puts)."""
        budget, threads, rounds = 2000, 6, 40
        tier = tier_cls.example(str(tmp_path), budget)
        over, barrier = [], threading.Barrier(threads)

        def work(i: int) -> None:
            barrier.wait()
            for r in range(rounds):
                for key in (f"own{i}/{r % 3}", "shared"):
                    tier.put(key, bytes([i]) * (100 + 37 * ((i + r) % 5)))
                    n = tier.nbytes
                    if n > budget:
                        over.append(n)
                if r % 4 == 3:
                    tier.delete(f"own{i}/{r % 3}")

        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
            for t in workers:
                t.start()
            for t in workers:
                t.join()
        finally:
            sys.setswitchinterval(old)
        assert not over, f"nbytes went over the {budget} B budget: {max(over)}"
        stored = sum(len(tier.get(k)) for k in list(tier.keys()))
        assert tier.nbytes == stored, f"nbytes {tier.nbytes} for {stored} B stored"
        for k in list(tier.keys()):
            tier.delete(k)
        assert tier.nbytes == 0 and tier.put("after", b"x" * budget)

    def test_prefix_listing(self, tier_cls, tmp_path):
        tier = tier_cls.example(str(tmp_path), None)
        for key in ["chunks/aa/1", "chunks/ab/2", "manifests/3", "chunksx"]:
            tier.put(key, b"v")
        assert sorted(tier.keys_with_prefix("chunks/")) == ["chunks/aa/1", "chunks/ab/2"]
        assert sorted(tier.keys_with_prefix("manifests/")) == ["manifests/3"]
        assert sorted(tier.keys_with_prefix("chunks")) == ["chunks/aa/1", "chunks/ab/2", "chunksx"]

    def test_read_into_fills_buffer(self, tier_cls, tmp_path):
        tier = tier_cls.example(str(tmp_path), None)
        data = np.random.default_rng(0).integers(0, 255, 4096, dtype=np.uint8)
        tier.put("blob", data)
        out = bytearray(5000)
        assert tier.read_into("blob", memoryview(out)) == 4096
        assert bytes(out[:4096]) == data.tobytes()
        assert tier.read_into("missing", memoryview(out)) is None

    def test_persistence_matches_flag(self, tier_cls, tmp_path):
        first = tier_cls.example(str(tmp_path), None)
        first.put("keep", b"value")
        second = tier_cls.example(str(tmp_path), None)
        if tier_cls.persistent:
            assert second.get("keep") == b"value"
            assert second.nbytes == 5
        else:
            assert second.get("keep") is None

    def test_keeps_files_matches_in_directory(self, tier_cls, tmp_path):
        """A tier with ``keeps_files`` (one a loader's ``spill=`` may name) keeps every value of
        ``in_directory(root)`` as a file below ``root``, unbounded, and leaves nothing else there;
        one without refuses ``in_directory`` with ``ConfigError``."""
        root = tmp_path / "level"
        root.mkdir(mode=0o700)
        if not tier_cls.keeps_files:
            try:
                tier_cls.in_directory(str(root))
            except ConfigError as exc:
                assert "keeps no files" in str(exc)
            else:
                raise AssertionError(f"{tier_cls.__name__}.in_directory made a tier, but keeps_files is False")
            return
        level = tier_cls.in_directory(str(root))
        assert isinstance(level, tier_cls) and level.capacity_bytes is None
        values = {0: b"first", 7: np.arange(6, dtype=np.int16).tobytes(), "x/y": b""}
        for key, value in values.items():
            assert level.put(key, value)
        files = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names)
        assert len(files) == len(values), f"files under the root: {files}"
        for key, value in values.items():
            assert level.get(key) == value and level.delete(key)
        assert [f for _d, _s, names in os.walk(root) for f in names] == []

    def test_model_based_operations(self, tier_cls):
        """Random put/delete/overwrite sequences agree with a dict (Hypothesis)."""
        from hypothesis import given, settings  # the test extra: importing the suite does not need it
        from hypothesis import strategies as st

        ops = st.lists(
            st.tuples(st.sampled_from(["put", "delete", "get"]), st.sampled_from(["a", "b", "c/d", "c/e", 7]),
                      st.binary(max_size=64)),
            max_size=12,
        )

        @settings(max_examples=25, deadline=None)
        @given(ops)
        def check(sequence):
            tier = _fresh(tier_cls, 256)
            model: dict = {}
            for op, key, value in sequence:
                if op == "put":
                    fits = sum(len(v) for k, v in model.items() if k != key) + len(value) <= 256
                    assert tier.put(key, value) is fits
                    if fits:
                        model[key] = value
                elif op == "delete":
                    assert tier.delete(key) is (model.pop(key, None) is not None)
                else:
                    got = tier.get(key)
                    assert (None if got is None else bytes(memoryview(got).cast("B"))) == model.get(key)
            assert sorted(map(str, tier.keys())) == sorted(map(str, model))
            assert tier.nbytes == sum(len(v) for v in model.values())

        check()
