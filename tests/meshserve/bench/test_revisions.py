"""The revisions benchmark's checkout: a git revision becomes a temporary detached
worktree holding that revision's files, removed afterwards; a folder is used as is."""

import subprocess
from pathlib import Path

from meshserve.bench.revisions import checkout

REPO = Path(__file__).resolve().parents[3]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def test_a_revision_is_checked_out_detached_and_removed_afterwards(monkeypatch):
    monkeypatch.chdir(REPO)
    first = git("rev-list", "--max-parents=0", "HEAD").splitlines()[0]
    with checkout(first) as tree:
        assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, check=True, capture_output=True,
                              text=True).stdout.strip() == first
        committed = subprocess.run(["git", "show", f"{first}:README.md"], cwd=REPO, check=True,
                                   capture_output=True).stdout
        assert (tree / "README.md").read_bytes() == committed
        assert str(tree) in git("worktree", "list")
    assert not tree.exists() and str(tree) not in git("worktree", "list")
    assert not tree.parent.exists()  # the temporary folder that held it too


def test_a_folder_is_used_as_it_is(tmp_path):
    with checkout(str(tmp_path)) as tree:
        assert tree == tmp_path.resolve()
    assert tmp_path.exists()
