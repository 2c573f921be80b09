"""CONTRIBUTING.md, executed: every path its map names exists, and each of its three recipes works as written."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def section(title: str) -> str:
    start = GUIDE.index(f"## {title}")
    end = GUIDE.find("\n## ", start + 1)
    return GUIDE[start : end if end != -1 else None]


def code_block(text: str, lang: str = "") -> str:
    match = re.search(rf"```{lang}\n(.*?)```", text, re.S)
    assert match, f"no ```{lang} block"
    return match.group(1)


def test_every_path_the_map_names_exists():
    rows = [line for line in code_block(section("Where things live")).splitlines() if line.strip()]
    assert len(rows) >= 10
    checked = 0
    for row in rows:
        first, rest = row.split(maxsplit=1)
        assert (ROOT / first).exists(), f"the map names {first}, which does not exist"
        # Names further along a row are relative to the repository or to the row's own folder.
        base = ROOT / first if first.endswith("/") else (ROOT / first).parent
        for name in re.findall(r"[\w./-]+(?:\.py|/)(?=[\s,;)]|$)", rest):
            assert (ROOT / name).exists() or (base / name).exists(), f"{row!r} names {name}, which does not exist"
            checked += 1
    assert checked >= 20


def test_every_file_path_in_the_guide_exists():
    for name in set(re.findall(r"`((?:harness|variants|tests|docs|slurm)/[\w./-]+)`", GUIDE)):
        if "my_" in name:  # the files a recipe asks the contributor to write
            continue
        assert (ROOT / name.split("::")[0]).exists(), f"CONTRIBUTING.md names {name}, which does not exist"


def test_recipe_1_a_mixer_written_as_the_recipe_says_registers_and_runs(monkeypatch):
    import variants
    from harness.config import model_preset
    from harness.errors import UsageError
    from harness.model.factory import build_model
    from harness.registry import knob
    from variants.base import REGISTRY, DepthMixer, register

    recipe = section("Recipe 1")
    for name in ("variants.base.DepthMixer", "harness.registry.knob", '@register("my-mixer")', "MODULES"):
        assert name in recipe
    assert "preln" in variants.MODULES and (ROOT / "docs/variants.md").exists()
    # Registration goes into a copy of the registry, so the throwaway mixer is gone after this test.
    monkeypatch.setattr(REGISTRY, "_entries", dict(REGISTRY._entries))

    @register("my-mixer")
    class MyMixer(DepthMixer):
        """The residual stream with every layer's output scaled by a knob."""

        @dataclass
        class Config:
            scale: float = knob(1.0, "factor on every layer's output")

            def __post_init__(self):
                if not self.scale > 0:
                    raise ValueError(f"scale must be positive, got {self.scale}")

        def init_state(self, e):
            return e

        def read(self, state, layer):
            return state

        def write(self, state, layer, out):
            return state + self.cfg.scale * out

        def read_head(self, state):
            return state

        def mixing_matrix(self, trace):
            raise AssertionError("not called here")

        def stream_floats_per_token(self):
            return self.d_model

        def extra_flops_per_token(self):
            return 0

    cfg = model_preset("tiny")
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    torch.manual_seed(0)
    mine = build_model(cfg, "my-mixer(scale=1.0)")
    torch.manual_seed(0)
    preln = build_model(cfg, "preln")
    preln.load_state_dict(mine.state_dict(), strict=False)
    # With scale 1 the mixer is the residual stream, so it computes what PreLN computes on the same weights.
    torch.testing.assert_close(mine(idx), preln(idx))
    assert torch.isfinite(build_model(cfg, "my-mixer(scale=0.5)")(idx)).all()
    with pytest.raises(UsageError, match="scale must be positive"):
        build_model(cfg, "my-mixer(scale=-1)")

    class Incomplete(DepthMixer):
        @dataclass
        class Config:
            pass

    with pytest.raises(TypeError, match="does not implement"):
        register("incomplete")(Incomplete)


def test_recipe_2_a_copied_task_yaml_loads_through_lm_eval(monkeypatch, tmp_path):
    from lm_eval.tasks import TaskManager

    from harness.evaluation.tasks import TASKS_DIR

    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LM_HARNESS_CACHE_PATH", str(tmp_path / "lm_eval_cache"))
    recipe = section("Recipe 2")
    folder = re.search(r"YAMLs in `([\w/]+)/`", recipe).group(1)
    assert (ROOT / folder).resolve() == TASKS_DIR
    loader = re.search(r"`(harness/[\w/]+\.py)`", recipe).group(1)
    assert (ROOT / loader).exists()
    source = TASKS_DIR / re.search(r"`(offline_\w+\.yaml)` for multiple choice", recipe).group(1)
    assert (TASKS_DIR / "offline.yaml").exists()
    kept = re.search(r"keep `(custom_dataset: !function [\w.]+)`", recipe).group(1)
    text = source.read_text(encoding="utf-8")
    assert kept in text

    # The recipe itself: copy the YAML, set `task:`, keep the loader, load it through lm-eval's TaskManager.
    copied = tmp_path / "tasks" / "offline_recipe.yaml"
    copied.parent.mkdir()
    copied.write_text(re.sub(r"(?m)^task: \w+$", "task: offline_recipe", text), encoding="utf-8")
    manager = TaskManager(include_path=str(copied.parent), include_defaults=False)
    task = manager.load(["offline_recipe"])["tasks"]["offline_recipe"]
    documents = yaml.safe_load(re.sub(r"!function ", "", text))["metadata"]["documents"]
    assert len(list(task.eval_docs)) == documents


def test_recipe_3_the_recipe_code_registers_a_figure(tmp_path):
    from harness.reporting import items
    from harness.reporting.results import Sweep

    code = code_block(section("Recipe 3"), "python")
    assert code.startswith("from matplotlib.figure import Figure\n\nfrom harness.reporting.items import")
    namespace: dict = {}
    before = dict(items._ITEMS)
    try:
        exec(compile(code, "CONTRIBUTING.md", "exec"), namespace)
        item = items.get("figure", "my_figure")
        assert item.fn is namespace["my_figure"]
        assert item.needs == "`summary.json`" and item.summary.startswith("One sentence on what it shows")
        with pytest.raises(items.NoData, match="no finished run"):
            item.fn(items.Context(sweep=Sweep(tmp_path, [])))
    finally:
        items._ITEMS.clear()
        items._ITEMS.update(before)
    assert "from harness.reporting import items, report; print(items.listing())" in section("Recipe 3")


def test_the_readmes_python_example_runs_as_its_comment_says():
    code = code_block((ROOT / "README.md").read_text(), "python")
    assert "cfg.variant.config.groups  # 8" in code
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["cfg"].variant.config.groups == 8 and str(namespace["cfg"].variant) == "ldm-rls(groups=8)"
    assert namespace["model"].mixer.cfg is namespace["cfg"].variant.config
