"""A benchmark side's worker process (``rlx.bench.harness``): build once, then run on request."""

from __future__ import annotations

import json
import sys
import time
import traceback


def main() -> int:
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever the side prints must not break the protocol
    from rlx.bench.harness import peak_rss_mb, resolve

    def send(msg: dict) -> None:
        out.write(json.dumps(msg, default=float) + "\n")
        out.flush()

    spec = json.loads(sys.stdin.readline())
    try:
        t = time.perf_counter()
        run = resolve(spec["target"])(**spec["kwargs"])
        send({"ready": True, "setup_s": time.perf_counter() - t, "peak_rss_mb": peak_rss_mb()})
    except Exception as e:  # reported to the parent, which raises BenchError
        traceback.print_exc()
        send({"error": f"{type(e).__name__}: {e}"})
        return 1
    for line in sys.stdin:
        msg = json.loads(line)
        if msg != "run" and not (isinstance(msg, dict) and "run" in msg):
            break
        try:
            cpu = time.process_time()  # every thread of this process
            figures = dict(run() if msg == "run" else run(msg["run"]))
            figures.setdefault("cpu_s", time.process_time() - cpu)
        except Exception as e:
            traceback.print_exc()
            send({"error": f"{type(e).__name__}: {e}"})
            return 1
        figures["peak_rss_mb"] = peak_rss_mb()
        send(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
