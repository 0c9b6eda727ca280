"""`solar info` reports an fsspec protocol as available only when its packages are installed, and
the optional packages with their versions; opening a URL whose protocol lacks its package is a
MissingDependencyError that says what to install."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import sys

import fsspec
import pytest

import solar
from solar.cli import main
from solar.errors import MissingDependencyError

# protocol -> (the package it needs, a word of fsspec's own hint for it)
NEEDS = {"hdfs": ("pyarrow", "java"), "gs": ("gcsfs", "Google Storage"), "sftp": ("paramiko", "SFTPFileSystem")}


def _absent(protocol: str) -> str:
    """The package ``protocol`` needs, which must be absent here for the test to mean anything."""
    pkg = NEEDS[protocol][0]
    if importlib.util.find_spec(pkg) is not None:
        pytest.skip(f"{pkg} is installed here, so {protocol}:// cannot show a missing package")
    return pkg


def _info_json(capsys) -> dict:
    assert main(["info", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("protocol", sorted(NEEDS))
def test_info_lists_a_protocol_only_when_its_package_is_installed(protocol, capsys):
    pkg = _absent(protocol)
    with contextlib.suppress(ImportError):  # registers hdfs's class, which imports without pyarrow
        fsspec.get_filesystem_class(protocol)
    caps = _info_json(capsys)
    assert protocol not in caps["fsspec_protocols"]
    assert caps["fsspec_protocols_missing"][protocol] == f"pip install {pkg}"
    assert {"file", "memory"} <= set(caps["fsspec_protocols"])
    assert main(["info"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("fsspec_protocols "))
    assert protocol not in line.split(None, 1)[1].split(", ")


def test_info_lists_a_protocol_whose_package_is_installed(capsys):
    """s3 needs s3fs, which the test extras install."""
    if importlib.util.find_spec("s3fs") is None:
        pytest.skip("s3fs is not installed")
    assert "s3" in _info_json(capsys)["fsspec_protocols"]


def test_info_reports_a_protocol_whose_package_does_not_import(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # what `import s3fs` sees when it is not installed
    monkeypatch.delitem(importlib.import_module("fsspec.registry")._registry, "s3", raising=False)  # imported before
    caps = _info_json(capsys)
    assert "s3" not in caps["fsspec_protocols"] and caps["fsspec_protocols_missing"]["s3"] == "pip install s3fs"


@pytest.mark.parametrize("name", ["zstandard", "lz4", "safetensors", "matplotlib"])
def test_info_reports_optional_packages(name, capsys, monkeypatch):
    want = importlib.metadata.version(name) if importlib.util.find_spec(name) is not None else "missing"
    assert _info_json(capsys)[name] == want
    assert main(["info"]) == 0
    assert any(ln.split() == [name, want] for ln in capsys.readouterr().out.splitlines())
    monkeypatch.setitem(sys.modules, name, None)
    assert _info_json(capsys)[name] == "missing"


@pytest.mark.parametrize("protocol", sorted(NEEDS))
def test_opening_a_url_whose_protocol_package_is_missing_says_what_to_install(protocol):
    pkg, hint = _absent(protocol), NEEDS[protocol][1]
    url = f"{protocol}://host/data/train.h5"
    for open_it in (lambda: solar.H5Dataset(url),
                    lambda: solar.io_backends.open_backend(url).keys(),
                    lambda: solar.H5Dataset(f"simplecache::{url}")):
        with pytest.raises(MissingDependencyError) as err:
            open_it()
        msg = str(err.value)
        assert f"{protocol}://" in msg and hint in msg and msg.endswith(f"install it with `pip install {pkg}`"), msg


def test_ingest_of_a_url_whose_protocol_package_is_missing_is_one_line_with_exit_code_2(tmp_path, capsys):
    pkg = _absent("hdfs")
    url = "hdfs://namenode:8020/runs/run1.npy"
    assert main(["ingest", url, "-o", str(tmp_path / "o.h5"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"solar ingest: {url}: the hdfs:// protocol needs the package {pkg}") and err.count("\n") == 1
    assert f"pip install {pkg}" in err and list(tmp_path.iterdir()) == []
