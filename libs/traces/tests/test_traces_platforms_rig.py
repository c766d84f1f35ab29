"""Unit tests of the live-platform launcher's failure path: an install or start error reaches the
test that asked for the server (it fails, it is not skipped), and the venv stamp keys the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from evalbus.testing import platforms
from evalbus.testing.platforms import PlatformError, PlatformLauncher, PlatformPin, ensure_venv

pytestmark = pytest.mark.unit


def test_a_failed_start_is_raised_to_every_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def broken(root: Path) -> platforms.PlatformServer:
        calls.append(root)
        raise PlatformError("pip said no")

    monkeypatch.setitem(platforms.STARTERS, "mlflow", broken)
    launcher = PlatformLauncher(tmp_path)
    launcher.launch("mlflow")
    launcher.launch("mlflow")
    for _ in range(2):
        with pytest.raises(PlatformError, match="pip said no"):
            launcher.get("mlflow")
    assert calls == [tmp_path / "mlflow"]  # started once per session, even when it failed
    launcher.close()


def test_a_stamped_venv_is_reused_without_installing(tmp_path: Path) -> None:
    pin = PlatformPin("tool", "tool==1.0", "tool")
    venv = tmp_path / "tool-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "tool").write_text("#!/bin/sh\n")
    (venv / ".evalbus-pin").write_text("tool==1.0\n")
    assert ensure_venv(pin, tmp_path) == venv
    assert not (tmp_path / "tool-install.log").exists()  # nothing was installed
