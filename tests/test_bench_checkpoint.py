"""scripts/bench/bench_checkpoint.py runs each mode through the engine's checkpoint writer and reports, per save,
the stall beside the whole write (a tiny shape here: the figures mean nothing, the fields must be there)."""

from __future__ import annotations

import json

from tests.conftest import load_script


def test_both_modes_report_the_stall_beside_the_write(tmp_path, capsys):
    bench = load_script("scripts/bench/bench_checkpoint.py")
    bench.main(["--hidden", "32", "--vocab", "100", "--heads", "2", "--steps", "1", "--saves", "2",
                "--dir", str(tmp_path)])
    rows = {r["mode"]: r for r in map(json.loads, (ln for ln in capsys.readouterr().out.splitlines()
                                                    if ln.startswith("{")))}
    assert set(rows) == {"never", "always"}
    for r in rows.values():
        assert r["state_gib"] >= 0 and len(r["saves"]) == 2
        for s in r["saves"]:
            assert 0 <= s["stall_s"] <= s["write_s"]
    assert all(s["steps_during_write"] == 0 and s["stall_s"] == s["write_s"] for s in rows["never"]["saves"])
    assert not any(tmp_path.iterdir())  # each mode's checkpoints removed after it
