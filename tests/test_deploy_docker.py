"""deploy/docker: one Dockerfile per service, built from the workspace root.

No Docker engine runs here, so no image is built. Instead (1) each Dockerfile is checked for the
structure the deployment relies on — the third-party layer synced from the lock and the manifests
alone (`uv sync --frozen --no-install-workspace`) before any source is copied, so it caches; every
workspace member's manifest copied for that step; a non-root final user; the service's module as
entry point; the ports the manifests probe — and (2) the build stage is replayed without Docker:
its COPY steps (filtered by the Dockerfile's own `.dockerignore`) into a temporary folder and its
`uv sync` steps run there with the machine's uv, after which the environment must hold the
third-party packages only (step 1), then the service installed non-editable and importable
(step 2).
"""

from __future__ import annotations

import fnmatch
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "deploy" / "docker"
SERVICES = ("gateway", "dispatcher", "collector", "judge", "exporter")


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction."""

    keyword: str
    args: str
    stage: int


def parse(path: Path) -> list[Instruction]:
    """Instructions in order (continuations joined, comments dropped), with their stage index."""
    out: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        if keyword.upper() == "FROM":
            stage += 1
        out.append(Instruction(keyword.upper(), " ".join(args.split()), stage))
    return out


def workspace_members() -> list[str]:
    """Workspace members, from the root manifest's globs."""
    root = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    members: list[str] = []
    for pattern in root["tool"]["uv"]["workspace"]["members"]:
        members += sorted(p.parent.relative_to(REPO).as_posix() for p in REPO.glob(f"{pattern}/pyproject.toml"))
    return members


@pytest.mark.unit
@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile_structure(service: str) -> None:
    path = DOCKER / f"{service}.Dockerfile"
    steps = parse(path)
    build = [s for s in steps if s.stage == max(s.stage for s in steps) - 1]
    final = [s for s in steps if s.stage == max(s.stage for s in steps)]
    syncs = [i for i, s in enumerate(build) if s.keyword == "RUN" and "uv sync" in s.args]
    assert len(syncs) == 2, "a third-party sync, then the workspace sync"
    first, second = (build[i].args for i in syncs)
    for flag in ("--frozen", "--no-install-workspace", "--no-dev", f"--package evalbus-{service}"):
        assert flag in first, flag
    for flag in ("--frozen", "--no-dev", "--no-editable", f"--package evalbus-{service}"):
        assert flag in second, flag
    before = [s.args.split() for s in build[: syncs[0]] if s.keyword == "COPY" and not s.args.startswith("--from")]
    copied = {src for args in before for src in args[:-1]}
    expected = {"uv.lock", "pyproject.toml"} | {f"{m}/pyproject.toml" for m in workspace_members()}
    assert copied == expected, "only the lock and the manifests before the third-party sync"
    between = [s.args.split()[0] for s in build[syncs[0] : syncs[1]] if s.keyword == "COPY"]
    assert sorted(between) == ["libs", f"services/{service}"]
    user = next(s.args for s in reversed(final) if s.keyword == "USER")
    assert user.split(":")[0].isdigit()
    assert int(user.split(":")[0]) != 0, "the service runs as root"
    assert next(s.args for s in final if s.keyword == "ENTRYPOINT") == f'["python", "-m", "evalbus_{service}"]'
    env = " ".join(s.args for s in final if s.keyword == "ENV")
    exposed = {p for s in final if s.keyword == "EXPOSE" for p in s.args.split()}
    assert "HTTP_PORT=8080" in env
    assert "HTTP_HOST=0.0.0.0" in env
    kube_env = yaml.safe_load((REPO / "deploy/kubernetes/base/config.yaml").read_text(encoding="utf-8"))["data"]
    assert kube_env["HTTP_PORT"] in exposed
    if service == "collector":
        assert "4318" in exposed
    module = REPO / "services" / service / "src" / f"evalbus_{service}" / "__main__.py"
    assert module.exists()


def ignored(patterns: list[str], path: str) -> bool:
    """Whether a .dockerignore excludes `path` (last matching pattern wins; `!` re-includes)."""
    verdict = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern[1:] if negate else pattern
        if fnmatch.fnmatch(path, glob) or (glob.endswith("/**") and path.startswith(glob[:-3] + "/")):
            verdict = not negate
    return verdict


def ignore_patterns(dockerfile: Path) -> list[str]:
    text = dockerfile.with_name(dockerfile.name + ".dockerignore").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.unit
@pytest.mark.parametrize("service", SERVICES)
def test_the_dockerignore_lets_in_what_the_build_copies_and_nothing_local(service: str) -> None:
    patterns = ignore_patterns(DOCKER / f"{service}.Dockerfile")
    for kept in ("uv.lock", "pyproject.toml", "libs/runtime/pyproject.toml", "libs/runtime/src/evalbus_runtime/bus.py"):
        assert not ignored(patterns, kept), kept
    assert not ignored(patterns, f"services/{service}/src/evalbus_{service}/__main__.py")
    for dropped in (".venv/bin/python", ".evalbus/token", "libs/runtime/tests/test_x.py", ".git/HEAD"):
        assert ignored(patterns, dropped), dropped
    other = next(s for s in SERVICES if s != service)
    assert ignored(patterns, f"services/{other}/src/evalbus_{other}/__main__.py")


def _uv() -> list[str]:
    if os.environ.get("UV"):
        return [os.environ["UV"]]
    found = shutil.which("uv")
    if found:
        return [found]
    return [sys.executable, "-m", "uv"]


def _copy(patterns: list[str], source: str, dest: Path) -> None:
    """COPY `source` (file or folder of the repo) to `dest`, as the build context would hold it."""
    src = REPO / source
    files = [src] if src.is_file() else [p for p in src.rglob("*") if p.is_file()]
    for f in files:
        rel = f.relative_to(REPO).as_posix()
        if ignored(patterns, rel):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("service", SERVICES)
def test_the_build_stage_replayed_without_docker_installs_the_service(service: str, tmp_path: Path) -> None:
    dockerfile = DOCKER / f"{service}.Dockerfile"
    patterns = ignore_patterns(dockerfile)
    steps = parse(dockerfile)
    build_stage = max(s.stage for s in steps) - 1
    workdir = tmp_path / "src"
    venv = tmp_path / "env"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "VIRTUAL_ENV", "PYTHON"))}
    syncs = 0
    for step in (s for s in steps if s.stage == build_stage):
        if step.keyword == "ENV":
            for assignment in shlex.split(step.args):
                key, _, value = assignment.partition("=")
                env[key] = str(venv) if key == "UV_PROJECT_ENVIRONMENT" else value
        elif step.keyword == "COPY" and not step.args.startswith("--from"):
            *sources, _ = step.args.split()
            for source in sources:
                _copy(patterns, source, workdir)
        elif step.keyword == "RUN" and "uv sync" in step.args:
            command = shlex.split(step.args[step.args.index("uv sync") :])
            result = subprocess.run(
                [*_uv(), *command[1:]], cwd=workdir, env=env, capture_output=True, text=True, timeout=600, check=False
            )
            assert result.returncode == 0, result.stderr
            syncs += 1
            site = next(venv.glob("lib/python*/site-packages"))
            installed = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
            if syncs == 1:
                assert not {n for n in installed if n.startswith("evalbus")}, "workspace installed in the cached layer"
                assert {"msgspec", "nats_py"} <= installed
    assert syncs == 2
    site = next(venv.glob("lib/python*/site-packages"))
    assert not list(site.glob("*evalbus*.pth")), "installed editable: the image would need the sources"
    probe = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-I",  # isolated: neither PYTHONPATH nor the user's site-packages
            "-c",
            f"import evalbus_{service}.__main__, evalbus_{service} as m; print(m.__file__)",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr
    assert str(site) in probe.stdout
    # package data (the gateway's dashboard assets and migrations) is in the installed package too
    package = REPO / "services" / service / "src" / f"evalbus_{service}"
    data = [
        p.relative_to(package)
        for p in package.rglob("*")
        if p.is_file() and p.suffix not in {".py", ".pyc"} and "__pycache__" not in p.parts
    ]
    missing = [str(d) for d in data if not (site / f"evalbus_{service}" / d).exists()]
    assert missing == []
