"""A plain (non-editable) install ships the embedded pair: ``load_pair`` finds it under site-packages."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_embedded_pair_lookup_order(monkeypatch, tmp_path):
    from specfit_hf import embedded

    monkeypatch.delenv("SPECFIT_TARGET_MODEL", raising=False)
    monkeypatch.delenv("SPECFIT_DRAFT_MODEL", raising=False)
    pair = embedded.embedded_pair()
    assert pair.target == REPO / "model_cards" / "specfit-tiny-qwen3moe"  # the checkout comes first
    assert (pair.draft / "config.json").is_file()
    monkeypatch.setenv("SPECFIT_DRAFT_MODEL", str(tmp_path))
    assert embedded.embedded_pair().draft == tmp_path
    assert embedded.embedded_pair_candidates()["draft"] == [tmp_path]


@pytest.mark.slow
def test_wheel_ships_the_pair_and_load_pair_finds_it(tmp_path):
    wheel_dir, site = tmp_path / "wheel", tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir), str(REPO)],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheel_dir.glob("specfit_hf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("specfit-tiny-qwen3moe", "specfit-tiny-qwen3moe-eagle3"):
        for f in ("config.json", "model.safetensors", "tokenizer.json"):
            assert f"specfit_hf/model_cards/{name}/{f}" in names
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    # Run from outside the checkout, with the installed copy first on the path.
    code = (
        "import specfit_hf, specfit_hf.embedded as e; from specfit_hf.cli import load_pair;"
        "t, d, tok = load_pair(None, None, 'cpu'); p = e.embedded_pair();"
        "print(specfit_hf.__file__); print(p.target); print(type(t).__name__, type(d).__name__)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFIT_")}
    env["PYTHONPATH"] = str(site)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    module_file, target_dir, classes = run.stdout.strip().splitlines()[-3:]
    assert module_file.startswith(str(site)) and target_dir.startswith(str(site))
    assert classes == "Qwen3MoeForCausalLM Eagle3DraftModel"
