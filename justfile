# evalbus task runner: `just --list` shows every recipe.
# Recipes run tools through `uv run --frozen` (the locked environment, created on first use), so they
# work from a fresh clone. Inside `uv run`, $UV names the uv that started us even when it is not on PATH.

set shell := ["bash", "-euo", "pipefail", "-c"]

uv := env("UV", "uv")
run := uv + " run --frozen"
code := "libs services src tests bench examples"
test_workers := env("EVALBUS_TEST_WORKERS", "2")

# List the recipes.
default:
    @{{just_executable()}} --list

# Start nats-server, PostgreSQL and the five services in .evalbus/ (idempotent).
up *args:
    {{run}} evalbus up {{args}}

# Stop everything `up` started.
down *args:
    {{run}} evalbus down {{args}}

# Health of every component (exit 0 only when all are healthy).
status *args:
    {{run}} evalbus status {{args}}

# Bring the stack up and run the example suite: live progress per stage, then the scorecard.
demo:
    {{run}} evalbus up
    {{run}} evalbus run examples/suite.yaml
    @echo "The stack stays up (evalbus tail / verify / rejudge / replay work on it); stop it with: just down"

# The whole test suite (unit, integration, e2e), each test file on one of
# EVALBUS_TEST_WORKERS (default 2) pytest-xdist workers; `-n 0` after it runs in one process.
test *args:
    {{run}} python -m pytest -n {{test_workers}} --dist loadfile {{args}}

# Unit tests only (no servers).
test-fast *args:
    {{run}} python -m pytest -m unit {{args}}

# The backend behaviour suite against a real Kubernetes cluster (docs/backends.md): kubeconfig, case image, namespace.
test-backends-live kubeconfig image="evalbus/case:latest" namespace="default" *args:
    EVALBUS_TEST_KUBECONFIG={{kubeconfig}} EVALBUS_TEST_IMAGE={{image}} EVALBUS_TEST_NAMESPACE={{namespace}} \
      {{run}} python -m pytest services/dispatcher/tests/test_backend_behaviour.py -k "kubernetes-live" {{args}}

# The same suite against a real Nomad agent (e.g. `nomad agent -dev` with the docker driver): address, case image.
test-backends-live-nomad addr image="evalbus/case:latest" *args:
    EVALBUS_TEST_NOMAD_ADDR={{addr}} EVALBUS_TEST_IMAGE={{image}} \
      {{run}} python -m pytest services/dispatcher/tests/test_backend_behaviour.py -k "nomad-live" {{args}}

# The same suite against a real Docker engine: its address (DOCKER_HOST form), case image (runner and Python inside).
test-backends-live-docker host="unix:///var/run/docker.sock" image="evalbus/case:latest" *args:
    EVALBUS_TEST_DOCKER_HOST={{host}} EVALBUS_TEST_IMAGE={{image}} \
      {{run}} python -m pytest services/dispatcher/tests/test_backend_behaviour.py -k "docker and not docker-fake" {{args}}

# ruff (lint and format check) and mypy --strict.
lint:
    {{run}} ruff check {{code}}
    {{run}} ruff format --check {{code}}
    {{run}} mypy {{code}}

# Format and apply safe lint fixes.
fmt:
    {{run}} ruff format {{code}}
    {{run}} ruff check --fix {{code}}

# Write docs/schemas/*.json from the contracts.
schemas:
    {{run}} evalbus schemas --out docs/schemas

# Run every benchmark in bench/ (each prints JSON).
bench:
    #!/usr/bin/env bash
    set -euo pipefail
    shopt -s nullglob
    files=(bench/*.py)
    if [ ${#files[@]} -eq 0 ]; then echo "no benchmark in bench/"; exit 0; fi
    for f in "${files[@]}"; do
      case "$(basename "$f")" in _*|plugins.py|soak.py) continue;; esac
      echo "== $f"; {{run}} python "$f"
    done

# The soak: a steady stream of cases for 30 minutes (RSS, sizes, p50/p99 per minute; table, JSON and a
# PNG chart in bench/results/); `just soak --minutes 5 --baseline-min 1` for a short one.
soak *args:
    {{run}} --group bench python bench/soak.py --check {{args}}

# The reliability suite: every fault scenario as one table (lost, duplicated, stall); exit 1 on a miss.
reliability *args:
    {{run}} python bench/reliability.py --check {{args}}

# Run every benchmark in bench/ with --check: exit 1 naming the benchmarks that missed a goal.
bench-check:
    #!/usr/bin/env bash
    set -euo pipefail
    shopt -s nullglob
    failed=()
    for f in bench/*.py; do
      case "$(basename "$f")" in _*|plugins.py|soak.py) continue;; esac
      echo "== $f --check"
      {{run}} python "$f" --check || failed+=("$f")
    done
    if [ ${#failed[@]} -gt 0 ]; then echo "goals missed in: ${failed[*]}" >&2; exit 1; fi
    echo "every benchmark met its goals"
