"""``dspark-jax serve``'s HTTP API, driven by the official ``openai`` client against a live server
on 127.0.0.1: a tiny random Llama target with SmolLM2's tokenizer and chat template, and an
untrained drafter under the production scheduler (so every answer is speculative)."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn

import dspark_jax
from dspark_jax.engine import Engine
from dspark_jax.serving.server import build_app
from dspark_jax.serving.worker import EngineWorker
from dspark_jax.target import init_target

MODEL = "tiny-smollm2-tokenizer"
SLOTS = 2
MAX_LEN = 512
SPS = [1.0] * 4 + [0.8] * 4 + [0.5] * 9  # a steps/s table over 0..16 forward tokens
QUESTION = "What is speculative decoding?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """The app served by uvicorn in a thread."""

    def __init__(self, worker: EngineWorker, tokenizer):
        self.worker, self.port = worker, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = build_app(worker, model_name=MODEL, tokenizer=tokenizer)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, **kwargs)

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            body = response.read().decode()
            return json.loads(body) if path != "/metrics" else body

    def post(self, path: str, data: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def wait_for(self, predicate, what: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while not predicate(self.get("/health")):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.worker.close()


@pytest.fixture(scope="module")
def tiny(smollm2):
    tokenizer = smollm2.tokenizer
    config = dict(architectures=["LlamaForCausalLM"], vocab_size=len(tokenizer), hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
                  eos_token_id=tokenizer.eos_token_id)
    target = init_target(config, seed=3, tokenizer=tokenizer)
    drafter = dspark_jax.init_drafter(target, seed=4, num_layers=1, block_size=4)
    return target, drafter


def start(tiny, *, max_queue: int = 16) -> LiveServer:
    target, drafter = tiny
    engine = Engine(target, drafter, slots=SLOTS, max_len=MAX_LEN, policy="production",
                    policy_params={"sps": SPS[:SLOTS * drafter.num_proposals + SLOTS + 1]})
    return LiveServer(EngineWorker(engine, max_queue=max_queue), target.tokenizer)


@pytest.fixture(scope="module")
def server(tiny):
    live = start(tiny)
    yield live
    live.close()


def test_models_health_and_metrics(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = server.get("/health")
    assert health["status"] == "ok" and health["slots"] == SLOTS
    text = server.get("/metrics")
    for name in ("dspark_requests_total", "dspark_queue_length", "dspark_slots_in_use",
                 "dspark_step_seconds_total", "dspark_generation_tokens_total"):
        assert f"# TYPE {name}" in text


def test_greedy_answers_equal_generate(server, tiny):
    target, _ = tiny
    want = dspark_jax.generate(target, [QUESTION], max_new_tokens=24)[0]
    client = server.client()
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24,
                                          messages=[{"role": "user", "content": QUESTION}])
    assert chat.choices[0].message.content == want.text
    assert chat.choices[0].finish_reason == ("stop" if want.token_ids[-1] in target.eos_token_ids
                                             else "length")
    assert chat.usage.completion_tokens == len(want.token_ids)
    assert chat.usage.prompt_tokens == want.stats["prompt_tokens"]
    prompt = "The capital of France is"
    ids = target.tokenizer(prompt)["input_ids"]
    completion = client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                           max_tokens=20)
    assert completion.choices[0].text == dspark_jax.generate(target, [ids], max_new_tokens=20)[0].text
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=20)
    assert by_ids.choices[0].text == completion.choices[0].text


def test_streamed_deltas_join_to_the_same_text(server):
    client = server.client()
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=40)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                 max_tokens=40, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3  # streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 40 and not chunks[-1].choices
    pieces = list(client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                            max_tokens=30, stream=True))
    plain = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                      max_tokens=30)
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text


def test_stop_strings_end_the_text_before_them(server):
    client = server.client()
    full = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                     max_tokens=60).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = full[:full.find(stop)]
    for stream in (False, True):
        response = client.completions.create(model=MODEL, prompt="Once upon a time",
                                             temperature=0, max_tokens=60, stop=[stop, "\x00"],
                                             stream=stream)
        chunks = list(response) if stream else [response]
        assert "".join(c.choices[0].text for c in chunks) == cut
        assert chunks[-1].choices[0].finish_reason == "stop"
    server.wait_for(lambda h: h["slots_in_use"] == 0, "the stopped requests' slots")


def test_concurrent_requests_all_complete(server):
    """More requests than slots, sampled and greedy mixed: every one completes, and the greedy
    ones give the answer they give alone. A seeded sampled request repeats its answer when it
    runs alone again (beside others, the production scheduler's budgets depend on them, and so
    does the sampled path; the law does not)."""
    client = server.client()

    def ask(i):
        return client.completions.create(model=MODEL, prompt="Hello", max_tokens=16,
                                         temperature=0 if i % 2 else 1.0, top_p=0.95,
                                         extra_body={"top_k": 50}, seed=5)

    greedy, sampled = ask(1).choices[0].text, ask(0).choices[0].text
    assert ask(0).choices[0].text == sampled != greedy
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
    assert [a.choices[0].text for a in answers[1::2]] == [greedy] * 4
    assert all(0 < a.usage.completion_tokens <= 16 for a in answers)


@pytest.mark.parametrize("body,status,needle", [
    (b'{"model": "tiny-smollm2-tokenizer", "messages": [', 400, "not valid JSON"),
    (b'{"model": "tiny-smollm2-tokenizer", "messages": []}', 400, "messages"),
    (b'{"model": "tiny-smollm2-tokenizer", "messages": [{"role": "user", "content": " "}]}', 400,
     "empty"),
    (b'{"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}', 404, "gpt-4"),
    (b'{"model": "tiny-smollm2-tokenizer", "messages": [{"role": "user", "content": "hi"}], '
     b'"temperature": 7}', 400, "temperature"),
    (b'{"model": "tiny-smollm2-tokenizer", "messages": [{"role": "user", "content": "hi"}], '
     b'"max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "tiny-smollm2-tokenizer", "messages": [{"role": "user", "content": "hi"}], '
     b'"max_tokens": 100000}', 400, "max_len"),
    (b'{"model": "tiny-smollm2-tokenizer", "messages": [{"role": "user", "content": "hi"}], '
     b'"n": 3}', 400, "n:"),
    (b'{"model": "tiny-smollm2-tokenizer", "messages": [{"role": "wizard", "content": "hi"}]}',
     400, "role"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "model"),
    (b'{"model": "tiny-smollm2-tokenizer", "messages": [{"role": "user", "content": "hi"}], '
     b'"stop": ["a", "b", "c", "d", "e"]}', 400, "stop"),
])
def test_bad_input_gets_a_named_4xx_and_the_server_lives_on(server, body, status, needle):
    code, error = server.post("/v1/chat/completions", body)
    assert code == status, error
    assert needle in error["error"]["message"] and error["error"]["type"], error
    assert server.get("/health")["status"] == "ok"


def test_bad_completion_prompts(server):
    for body, needle in ((b'{"model": "tiny-smollm2-tokenizer", "prompt": ""}', "empty"),
                         (b'{"model": "tiny-smollm2-tokenizer", "prompt": [99999999]}',
                          "outside the vocabulary"),
                         (b'{"model": "tiny-smollm2-tokenizer", "prompt": "a", "echo": true}',
                          "echo")):
        code, error = server.post("/v1/completions", body)
        assert code == 400 and needle in error["error"]["message"], error
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client().completions.create(model="nope", prompt="hi")


@pytest.fixture
def slow_steps(server, monkeypatch):
    """Engine steps of at least 20 ms, so that a long request is still running when its client
    goes away (the tiny model would otherwise finish first)."""
    engine = server.worker.engine
    step = engine.step

    def slow_step():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)


def test_a_disconnected_stream_frees_its_slot(server, slow_steps):
    before = server.get("/metrics")
    client = server.client()
    stream = client.completions.create(model=MODEL, prompt="Count", temperature=0,
                                       max_tokens=MAX_LEN - 8, stream=True)
    next(iter(stream))
    server.wait_for(lambda h: h["slots_in_use"] == 1, "the request's slot")
    stream.close()
    server.wait_for(lambda h: h["slots_in_use"] == 0, "the slot to be freed")
    assert _counter(server.get("/metrics"), 'status="aborted"') == _counter(before, 'status="aborted"') + 1


def test_a_disconnected_plain_request_frees_its_slot(server, slow_steps):
    """A non-streaming request whose client goes away is aborted too (the handler polls)."""
    import http.client

    before = _counter(server.get("/metrics"), 'status="aborted"')
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("POST", "/v1/completions", body=json.dumps(
        {"model": MODEL, "prompt": "Count", "temperature": 0, "max_tokens": MAX_LEN - 8}),
        headers={"Content-Type": "application/json"})
    server.wait_for(lambda h: h["slots_in_use"] == 1, "the request's slot")
    connection.close()
    server.wait_for(lambda h: h["slots_in_use"] == 0, "the slot to be freed")
    assert _counter(server.get("/metrics"), 'status="aborted"') == before + 1


def _counter(metrics: str, label: str) -> float:
    line = next(x for x in metrics.splitlines() if x.startswith("dspark_requests_total") and label in x)
    return float(line.split()[-1])


def test_a_full_queue_answers_429(tiny):
    """One slot busy, one request waiting, the next one refused with a message; the server
    then serves again."""
    live = start(tiny, max_queue=1)
    try:
        client = live.client()
        first = client.completions.create(model=MODEL, prompt="Count", temperature=0,
                                          max_tokens=MAX_LEN - 8, stream=True)
        next(iter(first))  # in a slot: the queue (of one) is free for the second
        second = client.completions.create(model=MODEL, prompt="Count", temperature=0,
                                           max_tokens=MAX_LEN - 8, stream=True)
        live.wait_for(lambda h: h["slots_in_use"] == 2, "both slots")
        third = client.completions.create(model=MODEL, prompt="Count", temperature=0,
                                          max_tokens=MAX_LEN - 8, stream=True)
        live.wait_for(lambda h: h["queue_length"] == 1, "a waiting request")
        with pytest.raises(openai.RateLimitError, match="queue is full"):
            client.completions.create(model=MODEL, prompt="Count", max_tokens=4)
        for stream in (first, second, third):
            stream.close()
        deadline = time.monotonic() + 30
        while _counter(live.get("/metrics"), 'status="aborted"') < 3:
            assert time.monotonic() < deadline, "the closed streams were not aborted"
            time.sleep(0.02)
        assert live.get("/health")["slots_in_use"] == 0 and live.get("/health")["queue_length"] == 0
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=4).choices[0].text is not None
        assert _counter(live.get("/metrics"), 'status="rejected"') == 1
    finally:
        live.close()


@pytest.mark.slow  # the server's answers are checked by default; this is the load client
def test_serve_bench_drives_a_server_over_http(server, tmp_path):
    """``serve-bench --url``: closed-loop streaming users; every request accounted for."""
    from dspark_jax import cli
    from dspark_jax.serving import http_load

    result = http_load.closed_loop(server.url, MODEL, ["Hi", "Count to three", "Name a color"] * 3,
                                   concurrency=4, max_tokens=8)
    assert (result["completed"], result["failed"], result["not_sent"]) == (9, 0, 0)
    assert result["completion_tokens"] == 9 * 8 and result["finish_reasons"] == {"length": 9}
    assert 0 < result["ttft_p50_s"] <= result["latency_p50_s"] <= result["latency_p99_s"]
    assert cli.main(["serve-bench", "--url", server.url, "--datasets", "gsm8k,mt-bench",
                     "--prompts", "4", "--concurrency", "1,2", "--max-new-tokens", "4",
                     "--max-prompt-len", "64", "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "serve_bench_http.json").read_text())
    assert [r["completed"] for r in report["results"]] == [4, 4] and report["model"] == MODEL
    failed = http_load.closed_loop(server.url, "no-such-model", ["Hi"], concurrency=1,
                                   max_tokens=4)
    assert failed["failed"] == 1 and "404" in failed["errors"][0]


def test_serve_command_names_bad_settings(capsys):
    from dspark_jax import cli

    assert cli.main(["serve", "--max-slots", "0"]) == 2
    assert "--max-slots and --max-queue must be >= 1" in capsys.readouterr().err
