"""`protrain train` (the arguments after this script's name) with every checkpoint save and
load of this rank measured: seconds and peak resident memory (``VmHWM``, reset through
``/proc/self/clear_refs`` before each, as `checkpoint_ranks.py` measures; Linux), one JSON
line per event appended to ``$CHECKPOINT_PROBE_DIR/rank<r>.jsonl``. The save and load are
the application's own (`protrain.train.checkpoint.sharded`, `protrain.train.checkpoint`),
wrapped here from outside; with ``CHECKPOINT_PROBE_NO_ROOM_CHECK=1`` (a resume that saves
nothing) the loop's free-space check before the run is skipped; nothing else changed.

Usage (what `resume_ranks.py --save-on` runs):
``CHECKPOINT_PROBE_DIR=out torchrun --nproc-per-node 2 benchmarks/checkpoint_probe.py train run.yaml``
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_ranks import _kib  # noqa: E402

_KIB = 1024


def _probe(what: str, fn):
    out = Path(os.environ["CHECKPOINT_PROBE_DIR"])
    rank = int(os.environ.get("RANK", "0"))

    @functools.wraps(fn)
    def measured(*args, **kwargs):
        before = _kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        row = {
            "rank": rank,
            "event": what,
            "seconds": round(time.perf_counter() - t0, 2),
            "rss_before_gib": round(before * _KIB / 2**30, 3),
            "peak_rss_gib": round(_kib("VmHWM") * _KIB / 2**30, 3),
            "added_gib": round((_kib("VmHWM") - before) * _KIB / 2**30, 3),
        }
        out.mkdir(parents=True, exist_ok=True)
        with (out / f"rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        return result

    return measured


def main() -> int:
    import protrain.train.checkpoint as ckpt
    import protrain.train.checkpoint.sharded as sharded
    import protrain.train.loop as loop
    from protrain.cli import main as protrain_main

    # the loop calls them through these modules' attributes
    sharded.save_sharded_checkpoint = _probe("sharded_save", sharded.save_sharded_checkpoint)
    sharded.load_sharded_checkpoint = _probe("sharded_load", sharded.load_sharded_checkpoint)
    ckpt.save_checkpoint = _probe("plain_save", ckpt.save_checkpoint)
    ckpt.load_checkpoint = _probe("plain_load", ckpt.load_checkpoint)
    loop.streamed_export.export_streamed = _probe(
        "streamed_export", loop.streamed_export.export_streamed
    )
    if os.environ.get("CHECKPOINT_PROBE_NO_ROOM_CHECK"):
        # a resume that saves nothing: the loop's room for one more checkpoint (the size of
        # the one resumed) is not asked of a disk that holds the model and that checkpoint
        loop.check_free_space = lambda *args: None
    return protrain_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
