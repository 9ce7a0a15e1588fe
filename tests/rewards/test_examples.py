"""The reward example of docs/rewards.md: user rewards from examples/my_rewards.py (decorator and import
path) score rows through `rlp rewards test` without training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_rlp_rewards_test_scores_rows_with_user_rewards():
    result = subprocess.run([str(Path(sys.executable).parent / "rlp"), "rewards", "test", "configs/custom_reward.yaml",
                             "--input", "examples/rows.jsonl"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    # row 0: "85" is right, short, no leading zero: 1.0 + 0.2 * 1.0 + 0.1 * 1.0
    assert rows[0]["reward"] == 1.3
    assert rows[0]["components"] == {"exact_match": 1.0, "brevity": 1.0, "no_leading_zero": 1.0}
    # row 1: "085" is wrong and has a leading zero: 0.2 * brevity(3 chars <= 3) = 0.2
    assert rows[1]["components"]["no_leading_zero"] == 0.0 and abs(rows[1]["reward"] - 0.2) < 1e-9
    # row 2: "3333333" is 7 chars, 4 over max_len 3: brevity max(0, 1 - 4/3) = 0
    assert rows[2]["components"]["brevity"] == 0.0
    assert "3 rows scored" in result.stderr


def test_rlp_rewards_list_shows_builtins_and_parameters():
    result = subprocess.run([str(Path(sys.executable).parent / "rlp"), "rewards", "list"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert any(line.startswith("exact_match") and "built-in" in line for line in result.stdout.splitlines())
