"""engine.chat's limits on a model file's chat template: a time limit that stops any
loop, a size cap checked before a long string is built, a stop from outside (the worker's job timeout),
and a worker whose template loops forever fails that job with `timeout` and goes on.

The normal templates (tests/test_chat.py, tests/test_chat_families.py) render as before under the limits.
"""
from __future__ import annotations

import signal
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from engine.chat import (
    CHATML_TEMPLATE,
    MAX_TEXT_CHARS,
    ChatFormat,
    ChatTemplateError,
    RenderStopped,
    TemplateLimitError,
    stop_rendering_when,
)

USER = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


# --------------------------------------------------------------------------- time
@pytest.mark.parametrize("template", [
    NESTED_LOOPS,  # the template: 10^10 empty iterations
    # a recursive macro that branches: 2^40 calls
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    # loops over a string: no function call, filter or attribute in them to hook
    "{% set s = 'ab' * 2000 %}{% for c in s %}{% for d in s %}{% for e in s %}{% endfor %}{% endfor %}{% endfor %}",
    # output all along, each piece small
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
])
def test_a_template_loop_is_stopped_by_the_time_limit(template):
    chat = ChatFormat(template, name="looping", time_limit=0.5)
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError, match=r"^chat template 'looping' was stopped: it ran past its time "
                                                 r"limit of 0\.5 s$"):
        chat.render(USER)
    assert time.monotonic() - t0 < 3.0
    # the same ChatFormat renders again (the limit is per render), and so do others
    with pytest.raises(TemplateLimitError):
        chat.render(USER)
    assert ChatFormat(CHATML_TEMPLATE).render(USER).endswith("<|im_start|>assistant\n")


def test_the_time_limit_leaves_no_exception_behind():
    """Renders that end around their deadline, many times: the watchdog's interruption lands inside the
    render or is withdrawn, never in the code that runs after it."""
    chat = ChatFormat("{% for i in range(messages[0].content|length) %}{% for j in range(100) %}{{ j }}"
                      "{% endfor %}{% endfor %}", name="edge", time_limit=0.01)
    outcomes = {"rendered": 0, "stopped": 0}
    for n in range(1, 121):
        try:
            chat.render([{"role": "user", "content": "x" * (n % 40 + 1) * 50}])  # 5k..200k iterations
            outcomes["rendered"] += 1
        except TemplateLimitError:
            outcomes["stopped"] += 1
        # plain Python work after each render: a stray interruption would surface here
        sum(i * i for i in range(2000))
    t_end = time.monotonic() + 0.3
    while time.monotonic() < t_end:
        sum(i for i in range(1000))
    # both happened (else this test proves nothing)
    assert outcomes["stopped"] > 0 and outcomes["rendered"] > 0, outcomes


def test_a_stop_from_outside_interrupts_rendering():
    """What the worker passes (pipeline.worker._JobEngine): the job's timeout or a forced stop."""
    chat = ChatFormat(NESTED_LOOPS, name="looping", time_limit=60)
    t0 = time.monotonic()
    with stop_rendering_when(lambda: time.monotonic() - t0 > 0.3):
        with pytest.raises(RenderStopped, match="stopped"):
            chat.render(USER)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert not isinstance(RenderStopped("x"), ValueError)  # not a ChatError: the engine does not call it a bad request
    # outside the context nothing stops it but its own limit
    chat = ChatFormat(NESTED_LOOPS, name="looping", time_limit=0.3)
    with pytest.raises(TemplateLimitError, match="time limit"):
        chat.render(USER)


def test_renders_in_two_threads_are_limited_separately():
    results: dict[str, object] = {}

    def run(key: str, template: str, limit: float) -> None:
        try:
            results[key] = ChatFormat(template, name=key, time_limit=limit).render(USER)
        except ChatTemplateError as e:
            results[key] = e

    threads = [threading.Thread(target=run, args=("slow", NESTED_LOOPS, 0.5)),
               threading.Thread(target=run, args=("fast", "{% for i in range(20000) %}x{% endfor %}", 30))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert isinstance(results["slow"], TemplateLimitError)
    assert results["fast"] == "x" * 20000


# --------------------------------------------------------------------------- size
HUGE = [
    ("{{ 'a' * 400000000 }}", "a repeated string or list would hold 400,000,000"),  # the template
    ("{{ 400000000 * 'a' }}", "a repeated string or list"),
    ("{% set s = 'a' * 4000000 %}{{ (s * 2) }}", "a repeated string or list would hold 8,000,000"),
    ("{{ [0] * 400000000 }}", "a repeated string or list"),
    ("{% set s = 'a' * 3000000 %}{{ s + s }}", "a concatenation would hold 6,000,000"),
    ("{% set s = 'a' * 3000000 %}{{ s ~ s }}", "a ~ concatenation"),
    ("{{ 'a'.center(400000000) }}", "str.center() is 400,000,000"),
    ("{{ 'a'.ljust(400000000) }}", "str.ljust()"),
    ("{{ 'a'|center(400000000) }}", "an argument of the center filter is 400,000,000"),
    ("{{ '%400000000s' % 'a' }}", "a % formatted string"),
    ("{{ '%s'|format('a' * 3000000) * 2 }}", "a repeated string"),
    ("{{ '{:>400000000}'.format('a') }}", "str.format()"),
    ("{{ '{0}{0}{0}'.format('a' * 2000000) }}", "str.format()"),
    ("{% set s = 'a' * 4000000 %}{{ ([s] * 1000) | join }}", "the result of the join filter"),
    ("{% set s = 'a' * 4000000 %}{{ ''.join([s] * 1000) }}", "str.join()"),
    ("{% set s = 'a' * 4000000 %}{{ s | replace('a', 'aaaa') }}", "the result of the replace filter"),
    ("{% set s = 'a' * 4000000 %}{{ s.replace('a', 'aaaa') }}", "str.replace()"),
    ("{% set s = '\\n' * 1000000 %}{{ s | indent(100) }}", "the result of the indent filter"),
    ("{% set s = 'a' * 4000000 %}{{ [s] * 1000 }}", "a printed value"),  # str() of the list
    ("{{ ([[0] * 1000] * 100000) | sum(start=[]) }}", "the result of the sum filter"),
    ("{{ 2 ** 100000000 }}", "a power of integers"),
    ("{{ {'a': 1} | tojson(indent=1000000) }}", "tojson(indent=1000000)"),
    ("{{ lipsum(1000000) }}", "lipsum() arguments"),
    # doubling in a loop: each step is within the cap until it is not
    ("{% set ns = namespace(s='a' * 1000) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "a ~ concatenation would hold"),
    # many strings each within the cap: the render's total
    ("{% set s = 'a' * 3000000 %}{% for i in range(100) %}{% set x = s + 'b' %}{% endfor %}", "in all"),
    # a macro body or captured block built from small pieces
    ("{% macro f() %}{% for i in range(100000) %}{{ 'abcdefghij' * 10 }}{% endfor %}{% endmacro %}{{ f() }}",
     "a captured block or macro output"),
    ("{% set x %}{% for i in range(100000) %}{{ 'abcdefghij' * 10 }}{% endfor %}{% endset %}{{ x }}",
     "a captured block or macro output"),
    # printed piece by piece: the output itself
    ("{% for i in range(100000) %}{{ 'abcdefghij' * 10 }}{% endfor %}", "would render more than 4,000,000"),
]


@pytest.mark.parametrize("template,why", HUGE)
def test_a_huge_string_is_refused_without_building_it(template, why):
    tracemalloc.start()
    try:
        with pytest.raises(TemplateLimitError, match=r"^chat template 'big' was stopped: .*") as info:
            ChatFormat(template, name="big").render(USER)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert why in str(info.value), info.value
    assert "\n" not in str(info.value)  # one line
    # at most a few strings at the cap exist at once (a cap-sized string is 4 MB), never the huge one
    assert peak < 8 * MAX_TEXT_CHARS + (16 << 20), f"{peak / 1e6:.0f} MB allocated"


def test_text_up_to_the_cap_still_renders():
    """The caps are on sizes the engine would refuse anyway (engine.engine.MAX_PROMPT_CHARS): a long but
    legal conversation renders."""
    long = "word " * 200_000  # 1 MB, the job schema's prompt limit
    chat = ChatFormat(CHATML_TEMPLATE)
    assert len(chat.render([{"role": "user", "content": long}])) > len(long)
    ok = ChatFormat("{{ 'ab' * 1000 }}|{{ '%5s' % 'x' }}|{{ '{:>4}'.format(1) }}|{{ 'a b'|replace(' ', '-') }}|"
                    "{{ ['x', 'y']|join(', ') }}|{{ 'x'|center(5) }}|{{ ', '.join(['p', 'q']) }}|{{ 2 ** 10 }}|"
                    "{{ [1] * 3 }}|{{ messages|map(attribute='content')|join }}")
    assert ok.render(USER) == "ab" * 1000 + "|    x|   1|a-b|x, y|  x  |p, q|1024|[1, 1, 1]|hi"


# --------------------------------------------------------------------------- in a worker
def _model_with_template(source: Path, directory: Path, template: str) -> Path:
    """The model file with its tokenizer.chat_template replaced (padded to the same length, so every
    offset in the file stays valid)."""
    from engine.gguf_file import GGUFFile

    data = bytearray(source.read_bytes())
    with GGUFFile(source) as g:
        original = g.metadata["tokenizer.chat_template"].encode()
    new = template.encode()
    assert len(new) <= len(original)
    at = data.index(original)
    data[at:at + len(original)] = new + b" " * (len(original) - len(new))
    path = directory / "looping-template.gguf"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.timeout(300)
def test_a_job_timeout_interrupts_a_looping_template_in_a_worker(smollm2_path, tmp_path):
    """The issue's case: nested range(100000) loops in the model's template, `--timeout 3`. The chat job
    fails with `timeout` within seconds (not at the template's own 5 s limit, not never), the worker takes
    the next job, and a first SIGTERM then stops it promptly."""
    from pipeline.client import Client
    from pipeline.collector import collect
    from pipeline.embedded import RedisServer, WorkerProcess, stop_workers, worker_argv
    from tests.conftest_redis import wait_for_workers

    model = _model_with_template(Path(smollm2_path), tmp_path, NESTED_LOOPS)
    with RedisServer() as server:
        client = Client(server.url)
        w = WorkerProcess(worker_argv(server.url, str(model), threads=1, name="loop-w1"), str(tmp_path / "w.log"))
        try:
            wait_for_workers(client.connection, ["loop-w1"])
            bid = client.submit_batch([
                {"model": str(model), "custom_id": "chat", "params": {"max_tokens": 3},
                 "messages": [{"role": "user", "content": "Say hi."}]},
                {"model": str(model), "custom_id": "text", "prompt": "The sky is", "params": {"max_tokens": 3}},
            ], timeout=3)
            t0 = time.monotonic()
            s = collect(client, bid, tmp_path / "out.jsonl", progress=False, timeout=60)
            took = time.monotonic() - t0
            assert (s.done, s.failed) == (1, 1), w.tail()
            results = dict(client.results(bid))
            assert results["chat"].status == "failed"
            assert results["chat"].error.code == "timeout", results["chat"].error
            assert "exceeded its timeout of 3 s" in results["chat"].error.message
            assert results["text"].status == "done"
            assert took < 20, took
            assert w.alive(), w.tail()
            w.signal(signal.SIGTERM)
            w.proc.wait(30)
        finally:
            stop_workers([w])
