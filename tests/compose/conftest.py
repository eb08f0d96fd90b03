"""Compose suite plumbing: engine and image set-up once, one verdict per scenario, a table at the end.

Set-up runs deploy/setup-docker.sh once, after collection and only when compose
tests are selected (so `pytest -m "not compose"` never touches Docker). When the
engine cannot be started the compose tests are skipped with a one-line reason;
when the image fails to build they fail with the script's message.

Environment knobs:
  SWARMPIPE_COMPOSE_RATE      first guess of training speed, micro-batches/s (60); each
                              scenario measures it and sizes the next trainer run from it
  SWARMPIPE_NEMESIS_SEED      seed of the nemesis schedule (default: random, printed)
  SWARMPIPE_NEMESIS_SECONDS   how long the nemesis injects faults (120)
  SWARMPIPE_COMPOSE_STRICT    1: soft checks (a healed peer gets work again) fail the scenario too
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compose_harness import REPO, Engine, HarnessError, Stack, prepare_engine, remove_leftovers  # noqa: E402

RUN_DIR = REPO / "runs" / f"compose-{time.strftime('%Y%m%d-%H%M%S')}"
RESULTS: list[dict] = []
STRICT = os.environ.get("SWARMPIPE_COMPOSE_STRICT", "") not in ("", "0")
STATE: dict = {
    "engine": None,
    "error": None,
    "skip": None,
    "rate": float(os.environ.get("SWARMPIPE_COMPOSE_RATE", "60")),
}


def _is_compose(item: pytest.Item) -> bool:
    return item.get_closest_marker("compose") is not None and "tests/compose" in str(item.path).replace(os.sep, "/")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = [item for item in items if _is_compose(item)]
    if not selected or config.option.collectonly:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    say = (lambda line: reporter.write_line(line)) if reporter else print
    say(f"compose: preparing Docker and the image (deploy/setup-docker.sh); logs in {RUN_DIR}")
    from compose_harness import SETUP_SCRIPT, sh

    probe = sh(["bash", str(SETUP_SCRIPT), "--engine-only"], timeout=600, check=False)
    if probe.returncode != 0:
        lines = [line for line in (probe.stdout + probe.stderr).splitlines() if line.strip()]
        reason = "Docker cannot be started here: " + (
            lines[-1].replace("setup-docker: FAILED: ", "") if lines else "unknown"
        )
        STATE["skip"] = reason
        for item in selected:
            item.add_marker(pytest.mark.skip(reason=reason))
        say(f"compose: {reason}")
        return
    try:
        engine = prepare_engine()
        remove_leftovers(engine)
        STATE["engine"] = engine
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        (RUN_DIR / "setup.log").write_text(engine.setup_log)
        for line in engine.setup_log.splitlines():
            if line.startswith("setup-docker: "):
                say("  " + line)
        say(f"compose: set-up took {engine.setup_seconds:.0f} s; compose command: {' '.join(engine.compose)}")
    except HarnessError as e:
        STATE["error"] = str(e)
        say(f"compose: set-up FAILED: {e}")


@pytest.fixture(scope="session")
def compose_engine() -> Engine:
    if STATE["skip"]:
        pytest.skip(STATE["skip"])
    if STATE["error"] or STATE["engine"] is None:
        pytest.fail(f"deploy/setup-docker.sh failed: {STATE['error']}", pytrace=False)
    return STATE["engine"]


# ---------------------------------------------------------------- verdicts
@dataclass
class Scenario:
    name: str
    description: str
    stack: Stack
    started: float = field(default_factory=time.monotonic)
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    recovery: str = ""
    error: str = ""

    def check(self, what: str, ok: bool, detail: str = "", soft: bool = False) -> bool:
        """Record an invariant. ``soft``: a failure is a warning in the verdict, not a failure
        (SWARMPIPE_COMPOSE_STRICT=1 makes soft checks hard)."""
        if soft and not ok and not STRICT:
            self.warnings.append(what)
            print(f"  [{self.name}] WARN {what}" + (f" ({detail})" if detail else ""), flush=True)
            return False
        self.checks.append((what, bool(ok), detail))
        mark = "ok  " if ok else "FAIL"
        print(f"  [{self.name}] {mark} {what}" + (f" ({detail})" if detail else ""), flush=True)
        return bool(ok)

    def note(self, text: str) -> None:
        print(f"  [{self.name}] {text}", flush=True)

    @property
    def rate(self) -> float:
        return STATE["rate"]

    def steps_for(self, seconds: float) -> int:
        """Micro-batches that keep the trainer busy about ``seconds`` at the measured speed."""
        return max(400, int(STATE["rate"] * seconds))

    def measure_rate(self) -> float:
        """Training speed so far (micro-batches/s, from the coordinator's view, past warm-up)."""
        mon = self.stack.monitor
        with mon.lock:
            pts = [(s.t, s.step) for s in mon.samples if s.step]
        if len(pts) < 2 or pts[-1][0] - pts[0][0] < 4:
            return STATE["rate"]
        rate = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
        self.facts["rate_mb_s"] = round(rate, 1)
        return rate

    def learn_rate(self, report: dict) -> None:
        """Size the next scenario's trainer from this one's speed (the faster estimate: load changes)."""
        elapsed = report.get("elapsed_s") or 0
        from_report = (report.get("microbatches_completed") or 0) / elapsed if elapsed > 0 else 0
        best = max(from_report, self.facts.get("rate_mb_s", 0))
        if best > 0:
            STATE["rate"] = round(best, 1)

    def assert_passed(self) -> None:
        failed = [f"{what} ({detail})" if detail else what for what, ok, detail in self.checks if not ok]
        assert self.passed, f"{self.name}: " + "; ".join(failed or ["no checks ran"])

    @property
    def passed(self) -> bool:
        return not self.error and bool(self.checks) and all(ok for _, ok, _ in self.checks)

    def record(self) -> dict:
        row = {
            "scenario": self.name,
            "verdict": "PASS" if self.passed else "FAIL",
            "wall_s": round(time.monotonic() - self.started),
            "recovery": self.recovery,
            "failed": [what for what, ok, _ in self.checks if not ok] + ([self.error] if self.error else []),
            "warnings": list(self.warnings),
            "description": self.description,
            **self.facts,
        }
        RESULTS.append(row)
        loss = (
            f"loss {row['loss_first']:.2f}->{row['loss_last']:.2f}"
            if isinstance(row.get("loss_first"), (int, float)) and isinstance(row.get("loss_last"), (int, float))
            else "loss n/a"
        )
        detail = (
            "; ".join(row["failed"])
            if row["failed"]
            else f"{row.get('steps', '?')} steps, {loss}, lost {row.get('lost', '?')}, recovery {self.recovery or 'n/a'}"
        )
        print(f"VERDICT {self.name}: {row['verdict']} in {row['wall_s']} s - {detail}", flush=True)
        return row


@pytest.fixture
def scenario(compose_engine: Engine, request: pytest.FixtureRequest):
    """``scenario(name, description, **stack_kwargs)`` -> Scenario; logs saved and the stack removed afterwards."""
    made: list[Scenario] = []

    def make(name: str, description: str, **stack_kwargs) -> Scenario:
        print(f"\n=== {name}: {description}", flush=True)
        stack = Stack(compose_engine, name, RUN_DIR / name, **stack_kwargs)
        sc = Scenario(name, description, stack)
        made.append(sc)
        return sc

    yield make
    for sc in made:
        err = getattr(request.node, "_compose_error", "")
        if err and all(ok for _, ok, _ in sc.checks):  # failed for a reason no check recorded: say which
            sc.error = err
        try:
            sc.stack.save_logs()
        except Exception as e:  # never let log collection hide the verdict
            print(f"  [{sc.name}] could not save logs: {e}")
        sc.stack.down()
        sc.record()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and call.excinfo is not None:
        exc = call.excinfo.value
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        item._compose_error = f"{type(exc).__name__}: {text}"[:200]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not RESULTS:
        return
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    (RUN_DIR / "verdicts.json").write_text(json.dumps(RESULTS, indent=2))
    header = f"{'scenario':<18} {'verdict':<7} {'wall s':>6} {'steps':>6} {'loss first->last':>17} {'lost':>4}  recovery / notes"
    lines = ["", "== swarmpipe Compose fault-injection suite ==", header, "-" * len(header)]
    for r in RESULTS:
        loss = (
            f"{r['loss_first']:.2f} -> {r['loss_last']:.2f}"
            if isinstance(r.get("loss_first"), (int, float)) and isinstance(r.get("loss_last"), (int, float))
            else "n/a"
        )
        notes = r["recovery"] or ""
        if r.get("warnings"):
            notes = (notes + "; " if notes else "") + "WARN: " + "; ".join(r["warnings"])
        if r["failed"]:
            notes = (notes + "; " if notes else "") + "FAILED: " + "; ".join(r["failed"])
        lines.append(
            f"{r['scenario']:<18} {r['verdict']:<7} {r['wall_s']:>6} {str(r.get('steps', '-')):>6} {loss:>17} "
            f"{str(r.get('lost', '-')):>4}  {notes}"
        )
    engine = STATE.get("engine")
    if engine is not None:
        lines.append(f"set-up (deploy/setup-docker.sh): {engine.setup_seconds:.0f} s; logs and reports: {RUN_DIR}")
    text = "\n".join(lines)
    (RUN_DIR / "verdicts.txt").write_text(text + "\n")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in lines:
            reporter.write_line(line)
    else:
        print(text)
