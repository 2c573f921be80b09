"""The documentation's links: every relative link of a Markdown page reaches a file, and its ``#anchor`` a heading
of that file; every ``docs/....md`` a page names exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pages() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    # Reports under results/ are generated, and link what their own run wrote.
    return [ROOT / name for name in listed.stdout.split() if not name.startswith("results/")]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text(encoding="utf-8"))
    return {slug(h) for h in re.findall(r"(?m)^#{1,6} (.+)$", text)}


def test_slug_follows_github():
    assert slug("What torch.compile gained on CPU") == "what-torchcompile-gained-on-cpu"
    assert slug("LDM and LDM-RLS: how their cost came down") == "ldm-and-ldm-rls-how-their-cost-came-down"
    assert slug("`depthmem status` on a 100-run sweep") == "depthmem-status-on-a-100-run-sweep"


def test_every_relative_link_reaches_its_file_and_heading():
    broken = []
    for page in pages():
        text = re.sub(r"(?ms)^```.*?^```", "", page.read_text(encoding="utf-8"))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_docs_page_a_page_names_exists():
    missing = {
        f"{page.relative_to(ROOT)}: {name}"
        for page in pages()
        for name in re.findall(r"(?<![\w/.])docs/[\w/.-]+\.md", page.read_text(encoding="utf-8"))
        if not (ROOT / name).exists()
    }
    assert not missing, sorted(missing)
