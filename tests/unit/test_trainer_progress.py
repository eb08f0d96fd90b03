"""swarmpipe.peer.trainer.progress: folding micro-batch outcomes into the trainer's tally, and the report."""

from __future__ import annotations

import dataclasses

import pytest

from swarmpipe.peer.trainer.outcome import MicrobatchOutcome, MicrobatchStatus
from swarmpipe.peer.trainer.progress import LOSS_WINDOW, Progress

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

REPORT_FIELDS = {
    "run_id",
    "steps",
    "microbatches_started",
    "microbatches_completed",
    "microbatches_retried",
    "microbatches_dropped_stale",
    "microbatches_lost",
    "microbatches_unfinished",
    "loss_first",
    "loss_last",
    "samples_per_s",
    "elapsed_s",
    "losses",
    "val_loss",
    "val_losses",
}


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def completed(loss: float, retries: int = 0) -> MicrobatchOutcome:
    return MicrobatchOutcome("mb", MicrobatchStatus.COMPLETED, loss=loss, retries=retries)


def stale(loss: float, retries: int = 0) -> MicrobatchOutcome:
    return MicrobatchOutcome(
        "mb", MicrobatchStatus.DROPPED_STALE, loss=loss, retries=retries, reason="gradient dropped as stale by stage 1"
    )


def failed(retries: int = 0) -> MicrobatchOutcome:
    return MicrobatchOutcome("mb", MicrobatchStatus.FAILED, retries=retries, reason="stage 1 has had no live replica")


def test_an_outcome_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        completed(1.0).loss = 2.0  # type: ignore[misc]


def test_start_counts_and_numbers_microbatches() -> None:
    p = Progress()
    assert [p.start(), p.start(), p.start()] == [1, 2, 3]
    assert p.started == 3 and p.unfinished == 3 and p.ended == 0


def test_each_status_goes_to_its_own_counter() -> None:
    p = Progress()
    for _ in range(4):
        p.start()
    p.apply(completed(2.0))
    p.apply(stale(3.0))
    p.apply(failed())
    assert (p.completed, p.dropped_stale, p.failed) == (1, 1, 1)
    assert p.ended == 3 and p.unfinished == 1 and p.lost == 1


def test_losses_of_completed_and_stale_microbatches_are_kept_in_order_a_failed_one_has_none() -> None:
    p = Progress()
    p.apply(completed(2.0))
    p.apply(failed())
    p.apply(stale(3.0))
    p.apply(completed(1.0))
    assert p.losses == [2.0, 3.0, 1.0]


def test_retries_are_summed_over_every_outcome_failed_ones_included() -> None:
    p = Progress()
    p.apply(completed(2.0, retries=2))
    p.apply(stale(2.0, retries=1))
    p.apply(failed(retries=3))
    p.apply(completed(2.0))
    assert p.retried == 6


def test_loss_ema_is_the_mean_of_the_last_window() -> None:
    p = Progress()
    assert p.loss_ema() is None
    for i in range(LOSS_WINDOW + 5):
        p.apply(completed(float(i)))
    last = list(range(5, LOSS_WINDOW + 5))
    assert p.loss_ema() == pytest.approx(sum(last) / len(last))


def test_samples_per_s_counts_completed_microbatches_only() -> None:
    clock = Clock()
    p = Progress(clock=clock)
    assert p.samples_per_s(16) == 0.0  # no time has passed: no division by zero
    p.apply(completed(1.0))
    p.apply(completed(1.0))
    p.apply(stale(1.0))
    clock.t += 4.0
    assert p.samples_per_s(16) == pytest.approx(2 * 16 / 4.0)


def test_recent_rate_forgets_what_happened_before_the_window() -> None:
    clock = Clock()
    p = Progress(clock=clock)
    for second in range(30):  # 10 micro-batches a second for 10 s, then 1 a second (read once a second)
        for _ in range(10 if second < 10 else 1):
            p.apply(completed(1.0))
        clock.t += 1.0
        p.recent_samples_per_s(1, window_s=10.0)
    assert p.recent_samples_per_s(1, window_s=10.0) == pytest.approx(1.0)
    assert p.samples_per_s(1) == pytest.approx(120 / 30)  # the rate since the start remembers the fast start


def test_report_has_every_field_and_adds_up() -> None:
    clock = Clock()
    p = Progress(clock=clock)
    for _ in range(5):
        p.start()
    for loss in (4.0, 3.0, 2.0):
        p.apply(completed(loss, retries=1))
    p.apply(stale(1.0))
    clock.t += 2.0
    report = p.report("run-x", microbatch_size=8)
    assert set(report) == REPORT_FIELDS
    assert report["run_id"] == "run-x"
    assert report["steps"] == report["microbatches_completed"] == 3
    assert report["microbatches_started"] == 5
    assert report["microbatches_retried"] == 3
    assert report["microbatches_dropped_stale"] == 1
    assert report["microbatches_lost"] == 0
    assert report["microbatches_unfinished"] == 1
    assert report["loss_first"] == report["loss_last"] == pytest.approx(2.5)  # fewer than a window: all four
    assert report["samples_per_s"] == pytest.approx(3 * 8 / 2.0)
    assert report["elapsed_s"] == pytest.approx(2.0)
    assert report["losses"] == [4.0, 3.0, 2.0, 1.0]
    assert report["val_loss"] is None and report["val_losses"] == []


def test_report_loss_first_and_last_are_windows_at_either_end() -> None:
    p = Progress()
    for i in range(3 * LOSS_WINDOW):
        p.apply(completed(float(i)))
    report = p.report("r", 1)
    assert report["loss_first"] == pytest.approx(sum(range(LOSS_WINDOW)) / LOSS_WINDOW)
    assert report["loss_last"] == pytest.approx(sum(range(2 * LOSS_WINDOW, 3 * LOSS_WINDOW)) / LOSS_WINDOW)


def test_an_empty_report_has_no_losses() -> None:
    report = Progress().report("r", 4)
    assert report["loss_first"] is None and report["loss_last"] is None and report["steps"] == 0


def test_the_dht_record_matches_the_tally() -> None:
    clock = Clock()
    p = Progress(clock=clock)
    p.apply(completed(2.0, retries=2))
    p.apply(failed(retries=1))
    clock.t += 1.0
    rec = p.record(microbatch_size=4)
    assert (rec.step, rec.microbatches_completed, rec.microbatches_retried, rec.microbatches_lost) == (1, 1, 3, 1)
    assert rec.loss == pytest.approx(2.0) and rec.samples_per_s == pytest.approx(4.0)


def test_validation_losses_go_to_the_report_and_the_newest_to_the_record() -> None:
    p = Progress()
    assert p.val_loss is None and p.record(4).val_loss is None
    p.validated(10, 3.5)
    p.validated(20, 3.25)
    report = p.report("r", 4)
    assert report["val_loss"] == 3.25 and report["val_losses"] == [[10, 3.5], [20, 3.25]]
    assert p.record(4).val_loss == 3.25
    p.validated(30, float("nan"))  # a value the record's bounds refuse is left out of it, not an error
    assert p.record(4).val_loss is None
