"""Asset cache mechanics on a fake wheel: no network, no pip.

.venv/bin/pytest tests/unit/test_assets_cache.py
"""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from splitlab import assets
from splitlab.errors import AssetError


@dataclass
class FakeAsset:
    spec: assets.AssetSpec
    calls: list[str]  # packages `pip download` was asked for


def _fake_wheel(folder: Path) -> tuple[Path, str]:
    wheel = folder / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_pkg/data/a.txt", "alpha")
        zf.writestr("fake_pkg/data/sub/b.txt", "beta")
        zf.writestr("fake_pkg/other.py", "")
    return wheel, hashlib.sha256(wheel.read_bytes()).hexdigest()


@pytest.fixture
def fake_asset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeAsset:
    """Register a `fake` asset whose pip download copies a local wheel and counts calls."""
    wheel, sha = _fake_wheel(tmp_path)
    calls: list[str] = []

    def fake_download(spec: assets.AssetSpec, dest: Path) -> Path:
        calls.append(spec.package)
        dest.mkdir(parents=True)
        target = dest / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    spec = assets.AssetSpec(
        package="fake-pkg",
        version="1.0",
        sha256=sha,
        member="fake_pkg/data",
        build=assets._build_copy_folder,
    )
    monkeypatch.setitem(assets.ASSETS, "fake", spec)
    monkeypatch.setattr(assets, "_pip_download", fake_download)
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "cache"))
    return FakeAsset(spec=spec, calls=calls)


def test_cache_dir_follows_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"


def test_cache_dir_default_is_home_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(assets.CACHE_ENV, raising=False)
    assert assets.cache_dir() == Path.home() / ".cache" / "splitlab"


def test_fetch_extracts_member_folder(fake_asset: FakeAsset) -> None:
    path = assets.fetch("fake")
    assert (path / "a.txt").read_text() == "alpha"
    assert (path / "sub" / "b.txt").read_text() == "beta"
    assert not (path / "other.py").exists()
    assert assets.is_cached("fake")


def test_a_fetch_is_one_line_and_a_cached_asset_none(
    fake_asset: FakeAsset, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO"):
        path = assets.fetch("fake")
        assets.fetch("fake")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert lines[0].startswith("fetching asset fake (fake-pkg==1.0): 4 steps in ")
    assert lines[0].endswith(f", ready at {path}")


def test_second_fetch_does_not_download(fake_asset: FakeAsset) -> None:
    first = assets.fetch("fake")
    second = assets.fetch("fake")
    assert first == second
    assert fake_asset.calls == ["fake-pkg"]


def test_no_temp_folders_left_after_fetch(fake_asset: FakeAsset) -> None:
    assets.fetch("fake")
    assert not list(assets.cache_dir().glob(".tmp-*"))


def test_checksum_mismatch_raises_and_publishes_nothing(
    fake_asset: FakeAsset, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = fake_asset.spec
    bad = replace(spec, sha256="0" * 64)
    monkeypatch.setitem(assets.ASSETS, "fake", bad)
    with pytest.raises(AssetError, match="sha256"):
        assets.fetch("fake")
    assert not assets.is_cached("fake")
    assert not assets.asset_dir("fake").exists()


def test_failed_build_publishes_nothing(
    fake_asset: FakeAsset, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(src: Path, out: Path) -> None:
        (out / "half-written").write_text("x")
        raise RuntimeError("disk full")

    spec = fake_asset.spec
    monkeypatch.setitem(assets.ASSETS, "fake", replace(spec, build=broken))
    with pytest.raises(AssetError, match="disk full"):
        assets.fetch("fake")
    assert not assets.asset_dir("fake").exists()
    assert not list(assets.cache_dir().glob(".tmp-*"))


def test_missing_member_raises(fake_asset: FakeAsset, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = fake_asset.spec
    monkeypatch.setitem(assets.ASSETS, "fake", replace(spec, member="nope/"))
    with pytest.raises(AssetError, match="no member"):
        assets.fetch("fake")


def test_unknown_asset_names_the_known_ones() -> None:
    with pytest.raises(AssetError, match="minilm"):
        assets.fetch("no_such_asset")


def test_resolve_passes_hub_ids_and_paths_through() -> None:
    assert assets.resolve("bert-base-uncased") == "bert-base-uncased"
    assert assets.resolve("/some/folder") == "/some/folder"


def test_resolve_fetches_asset_names(fake_asset: FakeAsset) -> None:
    assert assets.resolve("fake") == str(assets.asset_dir("fake"))


def test_entry_points_inside_the_folder(
    fake_asset: FakeAsset, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = fake_asset.spec
    monkeypatch.setitem(assets.ASSETS, "fake", replace(spec, entry="a.txt"))
    assert assets.fetch("fake").read_text() == "alpha"
