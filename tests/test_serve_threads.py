"""The decode steps' threads follow the host's load (magnetar.serve.threads): every usable CPU while the other
processes leave them idle, one fewer while they keep one busy -- measured from /proc/stat less the process's own CPU
time, with a band between the two where the count stays."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from magnetar.serve import threads
from magnetar.serve.threads import BUSY_CPUS, IDLE_CPUS, DecodeThreads, busy_seconds, decode_threads

HZ = float(os.sysconf("SC_CLK_TCK"))


def _stat(busy: dict[int, float], idle: float = 1000.0) -> str:
    """A /proc/stat text whose CPU c has spent ``busy[c]`` seconds busy, spread over user, system and steal (the
    idle and iowait fields large and unread)."""
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]  # the total line is not read
    for c, s in busy.items():
        j = round(s * HZ)
        user, system, steal = j // 2, j // 4, j - j // 2 - j // 4
        lines.append(f"cpu{c} {user} 0 {system} {round(idle * HZ)} 7 0 0 {steal} 0 0")
    return "\n".join(lines + ["intr 123 4 5", "ctxt 99", "cpu_not_a_cpu 1 2"]) + "\n"


def test_busy_seconds_counts_the_busy_fields_of_the_given_cpus_only():
    text = _stat({0: 10.0, 1: 20.0, 2: 400.0})
    assert busy_seconds(text, {0, 1}, HZ) == pytest.approx(30.0, abs=2 / HZ)
    assert busy_seconds(text, {2}, HZ) == pytest.approx(400.0, abs=1 / HZ)
    assert busy_seconds(text, {0, 3}, HZ) is None  # a CPU without its line: not measured


class _Host:
    """A fake host: ``advance(seconds, others, own)`` moves the clock, the other processes' busy CPU-seconds and this
    process's CPU-seconds (its own is busy time of the CPUs too)."""

    def __init__(self, cpus=(0, 1)):
        self.cpus, self.t, self.others, self.own = list(cpus), 100.0, 50.0, 5.0
        self.fail = False

    def read(self) -> str:
        if self.fail:
            raise OSError("no /proc here")
        total = self.others + self.own
        return _stat({c: total / len(self.cpus) for c in self.cpus} | {7: 1e6})  # CPU 7: not ours

    def advance(self, seconds: float, others: float, own: float = 0.0) -> None:
        self.t += seconds
        self.others += others * seconds
        self.own += own * seconds


def _policy(host: _Host, high=2, low=1) -> DecodeThreads:
    return DecodeThreads(high, low, set(host.cpus), period_s=1.0, read=host.read, own=lambda: host.own,
                         clock=lambda: host.t)


def test_every_cpu_while_the_others_leave_them_idle_one_fewer_while_they_do_not(caplog):
    host = _Host()
    p = _policy(host)
    assert p.current() == 1  # nothing measured yet: the safe count
    host.advance(0.5, others=0.0, own=2.0)
    assert p.current() == 1  # less than a window
    host.advance(0.6, others=0.05, own=1.9)  # this process's own threads are not the others
    with caplog.at_level(logging.INFO, logger="magnetar.serve.threads"):
        assert p.current() == 2
    assert p.others == pytest.approx(0.05 * 0.6 / 1.1, abs=0.02)
    assert "decode threads 1 -> 2" in caplog.text
    host.advance(1.0, others=(BUSY_CPUS + IDLE_CPUS) / 2, own=1.5)
    assert p.current() == 2  # between the two bounds: the count stays
    host.advance(1.0, others=1.0, own=1.0)  # another process keeps a CPU busy
    assert p.current() == 1
    host.advance(1.0, others=(BUSY_CPUS + IDLE_CPUS) / 2, own=1.0)
    assert p.current() == 1
    host.advance(1.0, others=0.0, own=1.0)
    assert p.current() == 2


def test_an_unreadable_proc_stat_keeps_the_safe_count():
    host = _Host()
    p = _policy(host, high=4, low=3)
    host.advance(2.0, others=0.0)
    assert p.current() == 4
    host.fail = True
    host.advance(2.0, others=0.0)
    assert p.current() == 3 and "unreadable" in p.broken
    host.fail = False
    host.advance(2.0, others=0.0)
    assert p.current() == 3  # broken for good: no window to measure from
    with pytest.raises(ValueError, match="low"):
        DecodeThreads(2, 2, {0, 1})


def test_the_policy_applies_only_where_the_count_is_the_servers_own_choice(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(threads, "_read_stat", lambda: _stat({c: 1.0 for c in range(4)}))
    p = decode_threads(None, 1, True)
    assert isinstance(p, DecodeThreads) and (p.high, p.low, p.cpus) == (4, 3, {0, 1, 2, 3})
    assert decode_threads(3, 1, True) is None  # --threads
    assert decode_threads(None, 2, True) is None  # other local ranks would count as the host's load
    assert decode_threads(None, 1, False) is None  # a GPU rank
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert decode_threads(None, 1, True) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads, "_read_stat", lambda: _stat({0: 1.0, 1: 1.0}))
    assert decode_threads(None, 1, True) is None  # CPUs 2 and 3 not in /proc/stat: not measured, the fixed rule
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5}, raising=False)
    assert decode_threads(None, 1, True) is None  # one CPU: nothing to choose


def test_the_server_decodes_at_the_policys_count(tmp_path):
    """The engine loop sets the policy's count before each decode step (a fake policy records the steps it was asked
    for and the count torch had when the next one asked), and restores its own count after a Phase 1."""
    pytest.importorskip("fastapi", reason="the serve extra: pip install 'magnetar[serve]'")
    openai = pytest.importorskip("openai", reason="the test extra: pip install 'magnetar[test]'")
    import magnetar
    from magnetar.serve.server import Server
    from tests.dist_utils import free_port, serve_in_thread
    from tests.tiny_models import save_tiny_chat

    class Fake:
        def __init__(self):
            self.asked, self.seen = 0, []

        def current(self):
            self.seen.append(torch.get_num_threads())
            self.asked += 1
            return 1 if self.asked % 2 else 2

    before = torch.get_num_threads()
    folder = save_tiny_chat(tmp_path / "m", 1024)
    engine = magnetar.init_inference(str(folder), method="dense", timeout_s=60)
    fake = Fake()
    try:
        torch.set_num_threads(2)
        with serve_in_thread(Server(engine, model_name="tiny", port=free_port(), max_tokens=6, prefill_threads=2,
                                    decode_threads=fake)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Go on."}],
                                               max_tokens=6, extra_body={"magnetar": {"context": "A short note."}})
            assert r.usage.completion_tokens >= 2
    finally:
        torch.set_num_threads(before)
    assert fake.asked >= r.usage.completion_tokens - 1  # once before each decode step
    # each step ran at the count the policy gave before it (odd asks 1, even asks 2)
    assert fake.seen[1:] == [1 if i % 2 else 2 for i in range(1, len(fake.seen))]
