"""`dropless bench ep` runs end to end on a tiny world and writes the documented JSON keys."""

from __future__ import annotations

import json
from pathlib import Path

from dropless.cli import main


def test_bench_ep_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ep.json"
    rc = main(["bench", "ep", "--nproc", "2", "--tokens", "16", "--dim", "16", "--experts", "8",
               "--top-k", "4", "--repeats", "1", "--warmup", "0", "--json", str(out)])
    assert rc == 0
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"exact", "exact+dedup", "buffered", "buffered+dedup"}
    for row in modes.values():
        for key in ("dispatch_combine_ms", "raw_all_to_all_ms", "raw_data_all_to_all_ms", "bytes_sent",
                    "bytes_sent_without_dedup"):
            assert row[key] > 0
        assert row["ratio"] == row["dispatch_combine_ms"] / row["raw_all_to_all_ms"]
    # k=4 over 2 ranks of 4 experts: every token has >= 2 pairs on some rank, so de-dup sends less
    assert modes["exact+dedup"]["bytes_sent"] < modes["exact"]["bytes_sent"]
    assert modes["exact"]["bytes_sent"] == modes["exact"]["bytes_sent_without_dedup"]
