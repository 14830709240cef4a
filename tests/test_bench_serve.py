"""benchmarks/bench_serve.py: the ``magnetar serve`` its peer and join parts start carries the bench's flags -- the
dtype above all (without it the server loaded the float32 checkpoint as it is, and a "bf16" comparison against
vLLM's bf16 served Magnetar in fp32)."""
from __future__ import annotations

import pytest

from tests.conftest import load_benchmark


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_served_process_gets_the_benchs_dtype_and_flags(dtype):
    bench = load_benchmark("bench_serve")
    args = bench.parse_args(["--dtype", dtype, "--method", "star", "--ranks", "2", "--decode-step", "graph",
                             "--max-batch", "8", "--new-tokens", "32", "--threads", "1"])
    args.model_path = "/models/smollm2"
    cmd = bench.serve_command(args, 8123, ("--max-join-tokens", "512"))

    def flag(name):
        return cmd[cmd.index(name) + 1]

    assert cmd[1:3] == ["-m", "magnetar.serve"] and flag("--model") == "/models/smollm2"
    assert flag("--dtype") == dtype and flag("--port") == "8123" and flag("--method") == "star"
    assert flag("--cp-size") == "2" and flag("--simulate") == "true" and flag("--decode-step") == "graph"
    assert flag("--max-batch-size") == "8" and flag("--max-tokens") == "32" and flag("--threads") == "1"
    assert flag("--max-join-tokens") == "512" and flag("--decode-graph-batches") == bench.graph_batches(8)
