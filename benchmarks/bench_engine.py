"""Engine speed benchmark beside the cost model: ``magnetar-bench`` (see magnetar/eval/bench.py).

    python benchmarks/bench_engine.py --methods star,pulsar --lengths 4096 --simulate-ranks 4
"""
import sys

from magnetar.eval.bench import main

if __name__ == "__main__":
    sys.exit(main())
