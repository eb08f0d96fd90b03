"""The trainer's state file: round trip, refusal of another run's or layout's state, hostile contents."""

from __future__ import annotations

import json

import pytest

from swarmpipe.peer.data import DataCursor, DataError
from swarmpipe.peer.trainer.progress import Progress
from swarmpipe.peer.trainer.resume import StateFile

pytestmark = pytest.mark.timeout(30)


def test_round_trip_restores_cursor_counters_and_validation(tmp_path):
    path = tmp_path / "state.json"
    first = StateFile(str(path), "run", 1, 3, "stream:corpus.txt")
    assert first.load().cursor == DataCursor() and not first.resumed
    progress = Progress()
    progress.completed, progress.dropped_stale, progress.failed, progress.retried = 17, 2, 1, 5
    progress.val_losses = [(0, 4.5), (10, 4.1)]
    first.save(DataCursor(epoch=1, position=40), progress)

    again = StateFile(str(path), "run", 1, 3, "stream:corpus.txt")
    assert again.load().cursor == DataCursor(epoch=1, position=40) and again.resumed
    restored = Progress()
    again.restore(restored)
    assert (restored.completed, restored.dropped_stale, restored.failed, restored.retried) == (17, 2, 1, 5)
    assert restored.started == 20 and restored.resumed == 17 and restored.val_losses == [(0, 4.5), (10, 4.1)]
    assert restored.samples_per_s(8) == 0.0  # rates count this process's work only
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    "other",
    [
        ("other-run", 1, 3, "stream:corpus.txt"),
        ("run", 0, 3, "stream:corpus.txt"),
        ("run", 1, 2, "stream:corpus.txt"),
        ("run", 1, 3, "stream:other.txt"),
    ],
)
def test_a_state_of_another_run_shard_layout_or_data_is_refused(tmp_path, other):
    path = tmp_path / "state.json"
    StateFile(str(path), "run", 1, 3, "stream:corpus.txt").save(DataCursor(0, 5), Progress())
    with pytest.raises(DataError, match="delete it to start over"):
        StateFile(str(path), *other).load()


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps([1, 2]),
        json.dumps({"format": "swarmpipe-trainer-state", "version": 99}),
        json.dumps(
            {
                "format": "swarmpipe-trainer-state",
                "version": 1,
                "run_id": "run",
                "shard": 1,
                "num_shards": 3,
                "data": "d",
                "cursor": {"epoch": -1, "position": 0},
            }
        ),
        json.dumps(
            {
                "format": "swarmpipe-trainer-state",
                "version": 1,
                "run_id": "run",
                "shard": 1,
                "num_shards": 3,
                "data": "d",
                "cursor": {"epoch": 0, "position": 0},
                "counters": {"completed": -4},
            }
        ),
        json.dumps(
            {
                "format": "swarmpipe-trainer-state",
                "version": 1,
                "run_id": "run",
                "shard": 1,
                "num_shards": 3,
                "data": "d",
                "cursor": {"epoch": 0, "position": 0},
                "val_losses": [["x"]],
            }
        ),
    ],
)
def test_hostile_or_corrupt_state_files_get_a_clear_error(tmp_path, content):
    path = tmp_path / "state.json"
    path.write_text(content)
    with pytest.raises(DataError):
        StateFile(str(path), "run", 1, 3, "d").load()


def test_an_oversized_state_file_is_refused_unread(tmp_path):
    path = tmp_path / "state.json"
    path.write_bytes(b" " * (2 << 20))
    with pytest.raises(DataError, match="larger than"):
        StateFile(str(path), "run", 0, 1, "d").load()


def test_no_state_file_means_no_writes(tmp_path):
    state = StateFile("", "run", 0, 1, "d")
    state.save(DataCursor(0, 3), Progress())
    assert state.load().cursor == DataCursor() and not list(tmp_path.iterdir())
