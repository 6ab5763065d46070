"""`rqllm watch` on a job that was restarted: the dead attempt's text is marked as discarded."""
from __future__ import annotations

from click.testing import CliRunner
from redis import Redis

from jobs import keys
from jobs.keys import dumps
from tests.conftest_redis import redis_server, redis_url  # noqa: F401


def test_watch_marks_the_text_of_a_dead_attempt_as_discarded(redis_url):  # noqa: F811
    from pipeline.cli import main

    job_id = "job-restarted"
    conn = Redis.from_url(redis_url)
    key = keys.token_stream_key(job_id)
    # What a follower sees across a restart: attempt 1's text, then attempt 2 from the start.
    for entry in ({"type": "start", "attempt": 1, "worker": "w1"}, {"type": "text", "text": "dead run "},
                  {"type": "start", "attempt": 2, "worker": "w2"}, {"type": "text", "text": "live run"},
                  {"type": "end", "status": "finished", "finish_reason": "stop"}):
        conn.xadd(key, {"d": dumps(entry)})

    res = CliRunner().invoke(main, ["watch", job_id, "--redis-url", redis_url, "--timeout", "10"])
    assert res.exit_code == 0, res.output
    before, marker, after = res.stdout.partition("[restarted: attempt 2 on w2; the text above was discarded]")
    assert marker, res.stdout
    assert "dead run" in before and "dead run" not in after
    assert after.strip() == "live run"
