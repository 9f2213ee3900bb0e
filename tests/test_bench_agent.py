"""The agent workload of `bench serve` (`--dataset agent`) against the scripted server on a virtual clock.

Sessions, turns, think times and the concurrency cap are checked against what the fake server saw
(every request body, in arrival order) and against the workload drawn before the run; TTFTs and the
token accounting against values derived from the script by hand. Nothing here reads a real clock.
"""
import numpy as np
import pytest

from tokenfab.bench.agent import AgentConfig, build_workload, parse_think_time
from tokenfab.bench.agent_run import run_agent
from tokenfab.bench.arrivals import arrival_times
from tokenfab.bench.client import Endpoint
from tokenfab.bench.fake_server import FakeScript, start_fake_server
from tokenfab.bench.prefix_cache import hit_rate, parse
from tokenfab.bench.serving import ServeConfig
from tokenfab.bench.session_stats import SentPrefixes
from tokenfab.bench.tokens import TokenCounter
from tokenfab.cli import main

pytestmark = pytest.mark.timeout(120)

TTFT_MS, PER_WORD_MS, INTERVAL_MS = 20.0, 0.1, 5.0
SYSTEM, USER, TOOL, OUT = 40, 6, 12, 4


def agent_bench(loop, *, sessions=3, turns="3", think="0", cap=None, rate=float("inf"), tool_calls=False, tools=2,
                seed=0):
    fake, server, url = loop.run_until_complete(start_fake_server(
        FakeScript(TTFT_MS, PER_WORD_MS, INTERVAL_MS, (1,), tool_calls=tool_calls)))
    agent = AgentConfig(num_sessions=sessions, turns=turns, system_len=str(SYSTEM), user_len=str(USER),
                        tool_len=str(TOOL), output_len=str(OUT), think_time=think, num_tools=tools)
    cfg = ServeConfig(base_url=url, model="fake-model", endpoint="chat", request_rate=rate, max_concurrency=cap,
                      warmup=1, percentiles=[50, 99], seed=seed, agent=agent)
    try:
        runs, _ = run_agent(cfg, TokenCounter(), Endpoint(url, "fake-model", kind="chat"), clock=loop.time,
                            run=loop.run_until_complete)
    finally:
        server.close()
    workload = build_workload(agent, TokenCounter(), seed)   # what the run drew: the same seed, the same draws
    return fake, runs[0], workload


def words(body) -> int:
    """What the fake server counts a request's prompt as: the words of its messages' contents."""
    return sum(len((m.get("content") or "").split()) for m in body["messages"])


def by_session(fake):
    """The timed requests (the warm-up's first one left out), grouped by their session's first user message."""
    out = {}
    for body, at in zip(fake.stats.bodies[1:], fake.stats.arrivals[1:]):
        out.setdefault(body["messages"][1]["content"], []).append((body, at))
    return list(out.values())


@pytest.mark.parametrize("tool_calls", [False, True])
def test_each_turn_resends_the_previous_turn_plus_its_reply_and_one_new_message(vloop, tool_calls):
    fake, run, w = agent_bench(vloop, sessions=3, turns="4", tool_calls=tool_calls)
    groups = by_session(fake)
    assert sorted(len(g) for g in groups) == [4, 4, 4]
    for group in groups:
        first = group[0][0]["messages"]
        assert [m["role"] for m in first] == ["system", "user"] and first[0]["content"] == w.system
        assert all(body["tools"] == w.tools for body, _ in group)
        for (prev, _), (body, _) in zip(group, group[1:]):
            msgs, before = body["messages"], prev["messages"]
            assert msgs[:len(before)] == before
            reply, new = msgs[len(before)], msgs[len(before) + 1:]
            assert reply["role"] == "assistant" and len(new) == 1
            called = tool_calls and before[-1]["role"] == "user"   # the fake calls a tool for a user turn only
            if called:
                call = reply["tool_calls"][0]
                assert call["function"] == {"name": w.tools[0]["function"]["name"],
                                            "arguments": '{"query": "' + " tok" * OUT + '"}'}
                assert new[0]["role"] == "tool" and new[0]["tool_call_id"] == call["id"]
                assert len(new[0]["content"].split()) == TOOL
            else:
                assert reply["content"] == " tok" * OUT and "tool_calls" not in reply
                assert new[0]["role"] == "user" and len(new[0]["content"].split()) == USER
    assert run.sessions["completed"] == 3 and run.summary["completed"] == 12


def test_turns_go_in_order_each_after_the_reply_and_the_drawn_think_time(vloop):
    fake, run, w = agent_bench(vloop, sessions=4, turns="uniform:2:5", think="exp:1.5", cap=2)
    records = run.records
    drawn_thinks = []
    for plan, s in zip(w.sessions, run.sessions["records"]):
        turns = [records[i] for i in s["requests"]]
        assert len(turns) == plan.turns == s["turns_planned"]
        assert [r.tag for r in turns] == [f"s{plan.index}-t{k + 1}" for k in range(plan.turns)]
        for k, (prev, r) in enumerate(zip(turns, turns[1:]), start=1):
            assert r.sent_s == pytest.approx(prev.end_s + plan.think_s[k], abs=1e-6)
            assert r.send_lag_ms == pytest.approx(0.0, abs=1e-6)
        assert s["think_s"] == plan.think_s[1:]
        drawn_thinks += plan.think_s[1:]
    assert len(set(drawn_thinks)) == len(drawn_thinks)   # exponential: drawn, not one fixed value


def test_a_fixed_think_time_separates_every_turn_by_exactly_that(vloop):
    assert parse_think_time("2.5").kind == parse_think_time("fixed:2.5").kind == "fixed"
    _, run, _ = agent_bench(vloop, sessions=2, turns="3", think="2.5")
    for s in run.sessions["records"]:
        turns = [run.records[i] for i in s["requests"]]
        assert [b.sent_s - a.end_s for a, b in zip(turns, turns[1:])] == pytest.approx([2.5, 2.5], abs=1e-6)


def test_at_most_max_concurrency_sessions_are_in_flight_think_times_included(vloop):
    fake, run, _ = agent_bench(vloop, sessions=6, turns="3", think="1", cap=2)
    spans = sorted((s["start_s"], s["end_s"]) for s in run.sessions["records"])
    live = [sum(a <= t < b for a, b in spans) for t, _ in spans]
    assert max(live) == 2
    assert fake.stats.max_in_flight <= 2
    # a session waits for a whole earlier session to end, not for a turn: the third starts as the first ends
    ends = sorted(b for _, b in spans)
    assert spans[2][0] == pytest.approx(ends[0], abs=1e-6)


def test_sessions_arrive_by_the_arrival_process(vloop):
    _, run, _ = agent_bench(vloop, sessions=5, turns="2", think="0.5", rate=2.0)
    firsts = [run.records[s["requests"][0]] for s in run.sessions["records"]]
    due = arrival_times(5, 2.0, 1.0, 0)
    assert [r.scheduled_s for r in firsts] == pytest.approx(due, abs=1e-6)
    assert [r.sent_s for r in firsts] == pytest.approx(due, abs=1e-6)


def test_ttft_by_turn_equals_the_script(vloop):
    fake, run, _ = agent_bench(vloop, sessions=4, turns="3", think="0.25")
    expected = {k: [] for k in (1, 2, 3)}
    for group in by_session(fake):
        for k, (body, _) in enumerate(group, start=1):
            expected[k].append(TTFT_MS + PER_WORD_MS * words(body))
    rows = run.sessions["by_turn"]
    assert [r["turn"] for r in rows] == [1, 2, 3]
    for row in rows:
        ttfts = expected[row["turn"]]
        assert row["requests"] == row["completed"] == 4
        assert row["mean_ttft_ms"] == pytest.approx(np.mean(ttfts), abs=1e-6)
        for p in (50, 99):
            assert row[f"p{p}_ttft_ms"] == pytest.approx(np.percentile(ttfts, p), abs=1e-6)
    assert rows[2]["mean_ttft_ms"] > rows[0]["mean_ttft_ms"]   # the fake's TTFT grows with the history


def test_resent_and_new_tokens_follow_the_history_by_hand(vloop):
    """Without tools or a template, the approximate counter counts a message as 4 tokens of role markup
    plus its words, and a prompt ends in 2 tokens that open the assistant's turn. So a session's first
    prompt is 4+S + 4+U + 2 tokens. The first one sent is new throughout; any other first turn shares the
    system message and the user's markup with it, leaving U + 2 new. A later turn adds the reply
    (4 + OUT) and a user message (4 + U) to the prompt before it, which it contains whole."""
    _, run, _ = agent_bench(vloop, sessions=3, turns="3", think="0", tools=0, cap=1)
    first = 4 + SYSTEM + 4 + USER + 2
    step = 4 + OUT + 4 + USER
    for s in run.sessions["records"]:
        turns = [run.records[i] for i in s["requests"]]
        assert [r.prompt_len for r in turns] == [first, first + step, first + 2 * step]
    rows = run.sessions["by_turn"]
    assert rows[0]["mean_new_tokens"] == pytest.approx((first + 2 * (USER + 2)) / 3)
    assert rows[1]["mean_new_tokens"] == rows[2]["mean_new_tokens"] == step
    sent = 3 * (3 * first + 3 * step)
    new = first + 2 * (USER + 2) + 3 * 2 * step
    assert (run.sessions["prompt_tokens"], run.sessions["new_tokens"]) == (sent, new)
    assert run.sessions["resent_share"] == pytest.approx(1 - new / sent)
    # the fake server counts words only: no markup, the reply's " tok"s included
    assert run.sessions["server_prompt_tokens"] == 3 * (3 * (SYSTEM + USER) + 3 * (OUT + USER))


def test_sent_prefixes_answer_the_longest_prefix_sent_before():
    seen = SentPrefixes()
    assert seen.add([1, 2, 3]) == 0
    assert seen.add([1, 2, 4]) == 2
    assert seen.add([1, 2, 3, 5]) == 3
    assert seen.add([1, 2, 3]) == 3
    assert seen.add([9]) == 0


def exposition(prefix: str, queries: float, hits: float) -> str:
    """Counters as a prometheus_client server writes them (tokenfab's /metrics, vLLM's)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily

    class Collector:
        def collect(self):
            for name, value in (("prefix_cache_queries", queries), ("prefix_cache_hits", hits)):
                c = CounterMetricFamily(prefix + name, "tokens", labels=["model_name"])
                c.add_metric(["m"], value)
                yield c
    registry = CollectorRegistry()
    registry.register(Collector())
    return generate_latest(registry).decode()


def test_prefix_cache_hit_rate_comes_from_the_counters_of_tokenfab_and_vllm():
    tokenfab = exposition("tokenfab:", 100, 40)
    vllm = ("vllm:prefix_cache_queries_total{engine=\"0\"} 200\nvllm:prefix_cache_queries_total{engine=\"1\"} 100\n"
            "vllm:prefix_cache_hits_total{engine=\"0\"} 90\n")    # untyped, two engines: summed
    before, after = parse(tokenfab), parse(vllm)
    assert before == {"prefix_cache_queries": 100, "prefix_cache_hits": 40}
    assert after == {"prefix_cache_queries": 300, "prefix_cache_hits": 90}
    assert hit_rate(before, after) == {"queries": 200, "hits": 50, "hit_rate": 0.25}
    assert parse("# TYPE process_open_fds gauge\nprocess_open_fds 7\n") is None
    assert hit_rate(None, after) is None


def test_a_server_without_the_counters_reports_no_hit_rate(vloop):
    _, run, _ = agent_bench(vloop, sessions=1, turns="2")
    assert run.sessions["prefix_cache"] is None


@pytest.mark.parametrize("args,says", [
    (["--endpoint", "completions"], "--endpoint chat"),
    (["--turns", "0"], "--turns"),
    (["--user-len", "lots"], "--user-len"),
    (["--think-time", "soon"], "--think-time"),
    (["--num-sessions", "0"], "--num-sessions"),
    (["--num-tools", "99"], "--num-tools"),
    (["--sweep", "auto"], "session rates"),
])
def test_agent_flag_mistakes_exit_2_with_a_one_line_reason(args, says, capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset", "agent", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
