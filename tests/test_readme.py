"""README.md is a contract: every fenced command block runs as written, from a fresh copy of the repository, with
no error, no traceback, and every file it says it writes there afterwards.

A block that needs what CI lacks carries a marker on the line above it, ``<!-- doc-test: skip REASON (why) -->``
(REASON: gpu, cluster, slurm, docker, download, long), and the README says so next to it; ``<!-- doc-test: ci -->``
marks the install and test blocks, which ``.ci/run`` runs itself. Those are reported as skipped with the reason.
"""

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- doc-test: (\w+)(?: (\w+))?(?: \(([^)]*)\))? -->\n)?```(bash|python)\n(.*?)```", re.S)
SKIPS = {"gpu", "cluster", "slurm", "docker", "download", "long"}
#: flags whose value is a file or folder the command writes
WRITES = re.compile(r"(?:^|\s)(?:-o|--output|--run-dir|--checkpoint-dir|--hf|--torch)[ =](\S+)|(?:^|\s)>\s*(\S+)")


def readme_blocks() -> list[tuple[str, str, str, str, str]]:
    """(id, marker, reason, language, code) of every fenced bash or python block, in order."""
    text = (ROOT / "README.md").read_text()
    out = []
    for m in BLOCK.finditer(text):
        marker, kind, why, lang, code = m.groups()
        section = ([h for h in re.findall(r"^## (.+)$", text[:m.start()], re.M)] or ["top"])[-1]
        ident = f"{len(out)}-{re.sub(r'[^a-z]+', '-', section.lower()).strip('-')}"
        reason = " ".join(x for x in (kind, why and f"({why})") if x)
        out.append((ident, marker or "", reason, lang, code))
    return out


BLOCKS = readme_blocks()


def test_every_block_is_run_or_says_why_not():
    assert len(BLOCKS) >= 12
    assert [b[1] for b in BLOCKS[:2]] == ["ci", "ci"]  # install and tests: .ci/run runs them itself
    for ident, marker, reason, _, _ in BLOCKS:
        assert marker in ("", "ci", "skip"), (ident, marker)
        if marker == "skip":
            assert reason.split()[0] in SKIPS and "(" in reason, (ident, reason)
    assert sum(not b[1] for b in BLOCKS) >= 10  # most blocks run


def _copy_repo(dest: Path) -> None:
    """The files git knows or would add (tracked, and untracked ones it does not ignore), as a fresh checkout."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def written(code: str) -> list[str]:
    """The paths a block says it writes (those naming a variable are left out)."""
    return [p for pair in WRITES.findall(code) for p in pair if p and "$" not in p]


#: README blocks run at once: most of a block's time is spent starting processes (Ray, its workers), which
#: leaves room for a second block on CI's two cores (about 1.6x faster in all than one at a time)
JOBS = int(os.environ.get("CHIMERA_README_JOBS", "2"))


def _run_block(ident: str, lang: str, code: str, repo: Path) -> subprocess.CompletedProcess[str]:
    """Block ``ident`` run from a fresh copy of the repository at ``repo``, as a user would (module docstring)."""
    _copy_repo(repo)
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(repo)}
    env.pop("RAY_ADDRESS", None)
    if lang == "python":
        (repo / "readme_block.py").write_text(code)
        argv = [sys.executable, "readme_block.py"]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    return subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=840)


@pytest.fixture(scope="module")
def block_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Every selected, unmarked block started in README order, ``JOBS`` at a time: ident -> (future, repo)."""
    wanted = {item.callspec.params["ident"] for item in request.session.items
              if item.originalname == "test_readme_block_runs_as_written"}
    pool = ThreadPoolExecutor(max_workers=max(1, JOBS))
    runs = {}
    for ident, marker, _, lang, code in BLOCKS:
        if ident in wanted and not marker:
            repo = tmp_path_factory.mktemp(ident) / "chimera"
            runs[ident] = (pool.submit(_run_block, ident, lang, code, repo), repo)
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("ident,marker,reason,lang,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_readme_block_runs_as_written(ident, marker, reason, lang, code, block_runs):
    if marker:
        pytest.skip(f"README block {ident}: {reason}")
    future, repo = block_runs[ident]
    p = future.result(timeout=880)
    out = p.stdout[-4000:] + "\n" + p.stderr[-4000:]
    assert p.returncode == 0, f"README block {ident} failed (exit {p.returncode}):\n{code}\n{out}"
    assert "Traceback (most recent call last)" not in p.stdout + p.stderr, out
    missing = [path for path in (written(code) if lang == "bash" else []) if not (repo / path).exists()]
    assert not missing, f"README block {ident} says it writes {missing}, which are not there:\n{out}"
    if "fine-tune" in ident:  # its last line: the largest logit difference, reloaded model against the pipeline
        assert float(p.stdout.strip().splitlines()[-1]) <= 1e-5, out
