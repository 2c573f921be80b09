"""CONTRIBUTING.md, executed: every module and file it names exists, and each of its recipes, applied as written
to a copy of the repository, passes the checks it ends with.

A recipe is read from its own code blocks: a block after a paragraph that starts with a file's path is that file,
new (the paragraph says ``new``) or changed by the block's diff; a ``bash`` block holds the commands that check the
result. Nothing else is written to the copy, so a file the recipe forgets to name fails its checks.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
RECIPES = ("Recipe 1", "Recipe 2", "Recipe 3", "Recipe 4")
RECIPE_IDS = ("mixer", "eval-task", "figure", "kernel")
# Recipe 4's kernel is the write of recipe 1's mixer, so recipe 1 is applied first.
BUILDS_ON = {"Recipe 4": ("Recipe 1",)}


def section(title: str) -> str:
    start = GUIDE.index(f"## {title}")
    end = GUIDE.find("\n## ", start + 1)
    return GUIDE[start : end if end != -1 else None]


@dataclass
class Block:
    lang: str
    body: str
    lead: str
    """The first line of the paragraph just before the block ("" when another block comes just before it)."""


def blocks(text: str) -> list[Block]:
    found, lead, after_blank = [], "", True
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("```"):
            body = []
            for inner in lines:
                if inner.startswith("```"):
                    break
                body.append(inner)
            found.append(Block(line[3:].strip(), "\n".join(body) + "\n", lead))
            lead, after_blank = "", True
        elif not line.strip():
            after_blank = True
        else:
            lead = line if after_blank else lead
            after_blank = False
    return found


@dataclass
class Step:
    path: str
    new: bool
    text: str


def recipe(title: str) -> tuple[list[Step], list[list[str]]]:
    """The files a recipe writes or changes, in order, and its check commands."""
    steps, commands = [], []
    for block in blocks(section(title)):
        if block.lang == "bash":
            commands += [shlex.split(line) for line in block.body.splitlines() if line.strip()]
            continue
        named = re.match(r"`([\w./-]+)`(, new)?", block.lead)
        assert named, f"{title}: a {block.lang} block follows {block.lead!r}, which does not start with a file's path"
        new = bool(named.group(2))
        assert new == (block.lang != "diff"), f"{title}: {named.group(1)} is new exactly when its block is no diff"
        steps.append(Step(named.group(1), new, block.body))
    return steps, commands


def patch(text: str, diff: str, path: str) -> str:
    """``text`` with each hunk of ``diff`` applied: its context and ``-`` lines, found exactly once, become its
    context and ``+`` lines; a hunk of ``+`` lines alone is appended."""
    for hunk in diff.rstrip("\n").split("\n@@\n"):
        old, new = [], []
        for line in hunk.splitlines():
            mark, rest = line[:1], line[1:]
            if mark in (" ", ""):
                old.append(rest)
                new.append(rest)
            elif mark == "-":
                old.append(rest)
            else:
                assert mark == "+", f"{path}: a diff line starts with {mark!r}"
                new.append(rest)
        if not old:
            text += "\n".join(new) + "\n"
            continue
        before, after = "\n" + "\n".join(old) + "\n", "\n" + "\n".join(new) + "\n"
        count = ("\n" + text).count(before)
        assert count == 1, f"{path}: the recipe's lines\n{before}\nare there {count} times, not once"
        text = ("\n" + text).replace(before, after)[1:]
    return text


def copy_of_the_repository(dest: Path) -> Path:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in listed.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def apply(tree: Path, title: str) -> list[list[str]]:
    steps, commands = recipe(title)
    for step in steps:
        target = tree / step.path
        assert target.exists() != step.new, f"{title}: {step.path} should {'not ' * step.new}exist before"
        target.parent.mkdir(parents=True, exist_ok=True)
        text = step.text if step.new else patch(target.read_text(encoding="utf-8"), step.text, step.path)
        target.write_text(text, encoding="utf-8")
    return commands


def test_the_layout_places_real_modules_and_names_real_files():
    rows = re.findall(r"(?m)^\| (\d+) \| `([\w.]+)` \| (.+) \|$", section("Where things live"))
    assert len(rows) >= 20
    checked = 0
    for _, module, text in rows:
        path = ROOT / module.replace(".", "/")
        assert path.is_dir() or path.with_suffix(".py").is_file(), f"the layout places {module}, which does not exist"
        for name in re.findall(r"[\w/]+(?:\.py|/)(?=[\s,;)]|$)", text):
            assert (path / name).exists() or (ROOT / name).exists(), f"{module}'s row names {name}, not there"
            checked += 1
    assert checked >= 20


def test_every_file_path_in_the_guide_exists():
    written = {step.path for title in RECIPES for step in recipe(title)[0] if step.new}
    for name in set(re.findall(r"`((?:harness|variants|tests|docs|slurm|experiments)/[\w./-]+)`", GUIDE)):
        if name not in written:
            assert (ROOT / name.split("::")[0]).exists(), f"CONTRIBUTING.md names {name}, which does not exist"


@pytest.mark.parametrize("title", RECIPES, ids=RECIPE_IDS)
def test_each_recipe_applies_to_a_copy_of_the_repository(title, tmp_path):
    tree = copy_of_the_repository(tmp_path)
    for earlier in BUILDS_ON.get(title, ()):
        apply(tree, earlier)
    commands = apply(tree, title)
    assert commands and all(c[:3] == ["python", "-m", "pytest"] for c in commands), commands


def test_patch_replaces_context_once_and_appends_bare_additions():
    text = "a\nb\nc\n"
    assert patch(text, " a\n-b\n+B\n c\n@@\n+d\n", "x") == "a\nB\nc\nd\n"
    with pytest.raises(AssertionError, match="0 times"):
        patch(text, " z\n+y\n", "x")


@pytest.mark.slow
@pytest.mark.parametrize("title", RECIPES, ids=RECIPE_IDS)
def test_each_recipe_passes_its_checks_as_written(title, tmp_path):
    tree = copy_of_the_repository(tmp_path / "repo")
    for earlier in BUILDS_ON.get(title, ()):
        apply(tree, earlier)
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["LM_HARNESS_CACHE_PATH"] = str(tmp_path / "lm_eval_cache")
    for command in apply(tree, title):
        done = subprocess.run(
            [sys.executable, *command[1:]], cwd=tree, env=env, capture_output=True, text=True, timeout=1200
        )
        assert done.returncode == 0, f"{title}: {shlex.join(command)} failed:\n{done.stdout[-4000:]}{done.stderr}"
        assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


def test_the_readmes_python_example_runs_as_its_comment_says():
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert "cfg.variant.config.groups  # 8" in code
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["cfg"].variant.config.groups == 8 and str(namespace["cfg"].variant) == "ldm-rls(groups=8)"
    assert namespace["model"].mixer.cfg is namespace["cfg"].variant.config
