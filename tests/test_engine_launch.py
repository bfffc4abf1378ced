"""Where the real engines' virtualenvs are looked for (``rollout/engines/launch.py``), without starting one."""

from __future__ import annotations

import pytest

from rollout.engines import launch


def test_the_default_engine_directory_is_the_repositorys_own_where_install_engines_puts_it(monkeypatch):
    monkeypatch.delenv("RALLYRL_ENGINES_DIR", raising=False)
    assert (launch.REPO_ROOT / ".ci" / "install_engines").is_file()
    assert (launch.REPO_ROOT / "pyproject.toml").is_file()
    assert launch.engines_dir() == launch.REPO_ROOT / ".engines"


def test_a_missing_engine_names_the_directory_and_the_command_that_installs_it(monkeypatch, tmp_path):
    monkeypatch.setenv("RALLYRL_ENGINES_DIR", str(tmp_path))
    monkeypatch.delenv("RALLYRL_VLLM_PYTHON", raising=False)
    with pytest.raises(launch.EngineNotInstalled, match=r"no vllm virtualenv at .*: run `.ci/install_engines vllm`"):
        launch.engine_python("vllm")
