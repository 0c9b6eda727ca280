"""`make docs`: the guide and the API reference build with no warning (mkdocs --strict), and a
headless Chromium renders the front page and the `solar.DataLoader` reference page with the
class's signature. Screenshots go to out/docs/ (what a reader sees)."""

from __future__ import annotations

import html
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
STRICT = os.environ.get("SOLAR_STRICT") == "1"
SHOTS = ROOT / "out" / "docs"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocstrings", reason="needs the test extra (mkdocs, mkdocstrings): run `make setup`")
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    assert "WARNING" not in r.stderr, r.stderr
    return out


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if STRICT:
            pytest.fail("chromium is missing under SOLAR_STRICT: `make setup` installs Debian's chromium")
        pytest.skip("needs chromium (Debian: apt-get install chromium)")
    return exe


def _browse(page: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--window-size=1280,1000", *args, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_every_reference_page_documents_its_objects(site):
    for page in sorted((site / "reference").glob("*.html")):
        text = page.read_text()
        assert 'class="doc doc-object' in text, f"{page.name}: no documented object (a ::: block collected nothing)"


@pytest.mark.parametrize("page, expect", [
    ("index.html", [r"Quick start", r"solar\.DataLoader\(ds, batch_size=64"]),
    ("reference/loader.html", [r"DataLoader\(\s*dataset,\s*batch_size: int \| None = 1,", r"buffer: Any =",
                               r"state_dict", r"load_state_dict"]),
])
def test_chromium_renders_the_page(site, page, expect):
    r = _browse(site / page, "--dump-dom")
    assert r.returncode == 0, r.stderr
    text = html.unescape(re.sub(r"<[^>]+>", "", r.stdout))
    for pattern in expect:
        assert re.search(pattern, text), f"{page}: the rendered page lacks {pattern!r}"
    SHOTS.mkdir(parents=True, exist_ok=True)
    shot = SHOTS / (page.replace("/", "-").removesuffix(".html") + ".png")
    r = _browse(site / page, f"--screenshot={shot}")
    assert r.returncode == 0 and shot.exists(), r.stderr
    import matplotlib.image as mpimg

    img = mpimg.imread(shot)
    assert img.shape[:2] == (1000, 1280)
    ink = np.abs(img[..., :3] - np.median(img[..., :3], axis=(0, 1))).sum(-1) > 0.3
    assert ink.mean() > 0.01, f"{shot}: the screenshot is (nearly) blank"
