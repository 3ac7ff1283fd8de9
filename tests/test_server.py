"""server.py through the real `openai` client: a server subprocess on a free localhost port, the tiny Qwen3
checkpoint on the CPU. Every answer is checked against what LLM.generate gives the same prompt alone."""
import concurrent.futures
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai", reason="the server tests need the test extra (openai)")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette", reason="the server needs the serve extra (starlette, uvicorn)")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import server as srv  # noqa: E402
import tinyflow  # noqa: E402
from conftest import free_port  # noqa: E402
from model import load  # noqa: E402


class Running:
    """A server.py subprocess; .url, .client (openai), .stop() (SIGINT, as Ctrl-C) returns its exit status."""

    def __init__(self, model, *options, api_key="none"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "server.py"), "--model", str(model), "--device", "cpu",
                                      "--no-compile", "--port", str(self.port), *options],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 300  # a bound on a wait for an event, never a speed asked of the machine
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "the server did not come up in 300 s"
            time.sleep(0.2)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def post(self, path, body, **kwargs):
        return httpx.post(self.url + path, content=body if isinstance(body, (bytes, str)) else json.dumps(body),
                          headers={"Content-Type": "application/json", **kwargs.pop("headers", {})}, timeout=300,
                          **kwargs)

    def active(self) -> int:
        return httpx.get(self.url + "/health").json()["active"]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=120)
        finally:
            self.proc.kill()


@pytest.fixture(scope="module")
def model_dir(checkpoints):
    return checkpoints["qwen3"]


@pytest.fixture(scope="module")
def server(model_dir):
    s = Running(model_dir, "--max-batch", "4", "--served-model-name", "tiny")
    yield s
    assert s.stop() == 0, "Ctrl-C must shut the server down cleanly"


@pytest.fixture(scope="module")
def alone(model_dir):
    """What LLM.generate gives one prompt alone, exactly max_tokens tokens (greedy unless sampling settings
    are given; ignore_eos=False: up to EOS): (text, ids)."""
    llm = tinyflow.LLM(str(model_dir), device="cpu", compile=False)

    def generate(prompt, max_tokens, chat=False, ignore_eos=True, **sampling):
        ids = llm.tokenizer.chat(prompt, **sampling.pop("chat_options", {})) if chat else prompt
        out = llm.generate([ids], max_new_tokens=max_tokens, ignore_eos=ignore_eos, batch_size=1, **sampling)[0]
        return out.text, out.token_ids
    return generate


HELLO = [{"role": "user", "content": "Hello world, hello tinyflow!"}]


@pytest.fixture(scope="module")
def tok(model_dir):
    return load(str(model_dir), torch.device("cpu"), torch.float32)[1]


def test_chat_completion_is_what_llm_generate_gives_alone(server, alone, tok):
    r = server.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=24, temperature=0,
                                              extra_body={"ignore_eos": True})
    text, ids = alone(HELLO, 24, chat=True)
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.completion_tokens, r.usage.prompt_tokens) == (24, len(tok.chat(HELLO)))


def test_completion_of_text_and_of_token_ids_is_what_llm_generate_gives_alone(server, alone, tok):
    text, ids = alone("The quick brown fox", 20)
    r = server.client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=20, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert r.choices[0].text == text and r.usage.completion_tokens == 20
    prompt_ids = tok.encode("The quick brown fox")
    r = server.client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=20, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert r.choices[0].text == text and r.usage.prompt_tokens == len(prompt_ids)


def test_streamed_chunks_add_up_to_the_whole_answer_and_end_with_usage(server, alone):
    text, _ = alone(HELLO, 30, chat=True)
    chunks = list(server.client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    streamed = list(server.client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=20,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == alone("The quick brown fox", 20)[0]
    assert streamed[-1].choices[0].finish_reason == "length" and streamed[-1].usage is None


def test_sixteen_concurrent_clients_on_four_rows_each_get_their_own_answer(server, alone):
    """Requests of different lengths arrive together; rows free up and refill at host syncs as each ends."""
    prompts = [f"Hello world {'hello ' * i}tinyflow" for i in range(16)]
    lengths = [5 + 3 * i for i in range(16)]
    ask = lambda i: server.client.completions.create(model="tiny", prompt=prompts[i], max_tokens=lengths[i],
                                                     temperature=0, extra_body={"ignore_eos": True})
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(ask, range(16)))
    for i, r in enumerate(replies):
        assert r.choices[0].text == alone(prompts[i], lengths[i])[0], f"request {i}"
        assert r.usage.completion_tokens == lengths[i]


def test_an_fp8_server_answers_what_an_fp8_llm_generate_gives_alone(model_dir):
    """--kv-dtype fp8 and --weights fp8 reach the engine and the model (on a CPU through the references:
    dequantize, then attend or multiply)."""
    llm = tinyflow.LLM(str(model_dir), device="cpu", compile=False, budget=40, kv_dtype="fp8", weights="fp8")
    want = llm.generate(["The quick brown fox"], max_new_tokens=60, ignore_eos=True, batch_size=1)[0].text
    for kv_dtype, weights in (("auto", "fp8"), ("fp8", "auto")):
        assert want != tinyflow.LLM(str(model_dir), device="cpu", compile=False, budget=40, kv_dtype=kv_dtype,
                                    weights=weights).generate(["The quick brown fox"], max_new_tokens=60,
                                                              ignore_eos=True, batch_size=1)[0].text, "FP8 changes no token"
    fp8 = Running(model_dir, "--max-batch", "2", "--budget", "40", "--kv-dtype", "fp8", "--weights", "fp8")
    try:
        r = fp8.client.completions.create(model=str(model_dir), prompt="The quick brown fox", max_tokens=60,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == want
    finally:
        assert fp8.stop() == 0


def test_on_the_cpu_the_default_rows_hold_16384_slots_in_all_so_a_reply_takes_seconds(model_dir, capsys):
    """A decode step reads every slot of every row, busy or not: 8 rows of SmolLM2's 8,192 full-cache slots
    took 23 s for an 8-token reply on a loaded 2-core CPU, 2 rows 5 s. So without --max-batch a CPU server
    decodes as many rows (1 to 8) as hold 16,384 slots in all; --max-batch is taken as given."""
    rows = lambda *extra: srv.build(srv.parse_args(["--model", str(model_dir), "--device", "cpu", "--no-compile",
                                                    *extra])).rows
    assert rows("--max-model-len", "8192", "--allow-long-context") == 2  # the full cache: a row per request
    assert rows("--max-model-len", "100000", "--allow-long-context") == 1
    assert rows("--budget", "64") == 8  # the tiny model's 512 positions, 64 slots a row
    assert rows("--max-model-len", "8192", "--allow-long-context", "--max-batch", "8") == 8
    with pytest.raises(SystemExit):
        srv.parse_args(["--help"])
    assert "on the CPU as many (1 to 8) as hold 16,384 KV slots in all" in " ".join(capsys.readouterr().out.split())


def test_a_default_sampling_setting_out_of_range_refuses_to_start_the_server(model_dir, tmp_path):
    """top_p 0 in generation_config.json would refuse every request that leaves top_p out: refused at startup."""
    folder = tmp_path / "ckpt"
    shutil.copytree(model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_p": 0}))
    with pytest.raises(ValueError) as refused:
        srv.build(srv.parse_args(["--model", str(folder), "--device", "cpu", "--no-compile"]))
    assert str(refused.value) == ("this model's generation_config.json sets top_p to 0, which must be a number in "
                                  "(0, 1]: correct it in that file")


def start_refused(model_dir, capsys, monkeypatch, *options) -> subprocess.CompletedProcess:
    """server.py's main in this process (no process start, ~2 s, per refusal), made to fail the test if it loads
    the model: its exit status, stdout and stderr, as a finished process's."""
    monkeypatch.setattr(srv, "build", lambda args: pytest.fail("the model was loaded before the address was checked"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        srv.main(["--model", str(model_dir), "--device", "cpu", "--no-compile", *options])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["server.py", *options], stop.value.code, out, err)


def test_a_port_in_use_is_refused_in_one_line_before_the_model_loads(model_dir, capsys, monkeypatch):
    """uvicorn binds only once the server is compiled (70 s on a GPU), then fails with its own ERROR and exit 3:
    the address is checked first, and the model is never loaded."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = start_refused(model_dir, capsys, monkeypatch, "--port", str(port))
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    assert r.stderr == (f"error: port {port} on 127.0.0.1 is in use (Address already in use); stop what listens "
                        f"there or give another --port\n")


@pytest.mark.parametrize("host, why", [("999.1.1.1", "Name or service not known"),
                                       ("192.0.2.1", "Cannot assign requested address")],  # TEST-NET-1: no one's
                         ids=["not-an-address", "not-this-machines"])
def test_a_host_that_is_not_this_machines_is_refused_in_one_line_before_the_model_loads(model_dir, host, why, capsys,
                                                                                      monkeypatch):
    r = start_refused(model_dir, capsys, monkeypatch, "--host", host, "--port", str(free_port()))
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    assert r.stderr == (f"error: --host {host} is not an address of this machine ({why}); give 127.0.0.1 (this "
                        f"machine only), 0.0.0.0 (every interface) or one of its own addresses\n")


def wait_until_idle(server, seconds=120.0):
    deadline = time.time() + seconds
    while server.active() and time.time() < deadline:
        time.sleep(0.1)
    return server.active() == 0


@pytest.fixture(scope="module")
def long_server(model_dir):
    """Room for 100,000-token requests (past the tiny model's 512 positions: allowed), one row, one waiting
    request at most, and an API key."""
    s = Running(model_dir, "--max-batch", "1", "--max-waiting", "1", "--max-model-len", "100000",
                "--allow-long-context", "--budget", "64", "--served-model-name", "tiny", "--api-key", "sesame",
                api_key="sesame")
    yield s
    assert s.stop() == 0


def test_a_client_that_disconnects_mid_stream_frees_its_row(long_server):
    auth = {"Authorization": "Bearer sesame"}
    response = httpx.stream("POST", long_server.url + "/v1/completions", timeout=60, headers=auth, json={
        "model": "tiny", "prompt": "Hello", "max_tokens": 90000, "ignore_eos": True, "stream": True})
    lines = response.__enter__().iter_lines()  # kept: dropping the iterator would close the stream
    next(lines)
    assert long_server.active() == 1
    response.__exit__(None, None, None)  # the client goes away
    assert wait_until_idle(long_server), "the row of a client that left was not freed"
    r = long_server.client.completions.create(model="tiny", prompt="Hello", max_tokens=5)
    assert r.usage.completion_tokens >= 1


def test_a_full_queue_answers_429_and_serving_goes_on(long_server):
    auth = {"Authorization": "Bearer sesame"}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 90000, "ignore_eos": True, "stream": True}
    first = httpx.stream("POST", long_server.url + "/v1/completions", timeout=60, headers=auth, json=body)
    lines = first.__enter__().iter_lines()
    next(lines)  # it holds the only row
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(long_server.client.completions.create, model="tiny", prompt="Hi", max_tokens=3)
        deadline = time.time() + 120
        while httpx.get(long_server.url + "/health").json()["waiting"] < 1 and time.time() < deadline:
            time.sleep(0.05)
        r = long_server.post("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 3}, headers=auth)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        first.__exit__(None, None, None)
        assert waiting.result(timeout=300).usage.completion_tokens >= 1  # admitted once the row freed


def test_the_api_key_is_checked_on_every_endpoint(long_server):
    for key in (None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert long_server.post("/v1/completions", {"model": "tiny", "prompt": "Hi"}, headers=headers
                                ).status_code == 401
        assert httpx.get(long_server.url + "/v1/models", headers=headers).status_code == 401
    models = httpx.get(long_server.url + "/v1/models", headers={"Authorization": "Bearer sesame"}).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


BAD = [  # (what, body, status, param)
    ("malformed JSON", b'{"model": "tiny", ', 400, None),
    ("not an object", [1, 2], 400, None),
    ("no model", {"prompt": "Hi"}, 400, "model"),
    ("an unknown model", {"model": "gpt-5", "prompt": "Hi"}, 404, "model"),
    ("max_tokens 0", {"model": "tiny", "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens a string", {"model": "tiny", "prompt": "Hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("max_tokens past the context", {"model": "tiny", "prompt": "Hi", "max_tokens": 600}, 400, "max_tokens"),
    ("a temperature of 3", {"model": "tiny", "prompt": "Hi", "temperature": 3}, 400, "temperature"),
    ("a temperature that is 0 in fp32", {"model": "tiny", "prompt": "Hi", "temperature": 1e-300}, 400, "temperature"),
    ("top_p 0", {"model": "tiny", "prompt": "Hi", "top_p": 0}, 400, "top_p"),
    ("a seed past 64 bits", {"model": "tiny", "prompt": "Hi", "seed": 2**70}, 400, "seed"),
    ("an empty stop string", {"model": "tiny", "prompt": "Hi", "stop": [""]}, 400, "stop"),
    ("n = 2", {"model": "tiny", "prompt": "Hi", "n": 2}, 400, "n"),
    ("logprobs", {"model": "tiny", "prompt": "Hi", "logprobs": 5}, 400, "logprobs"),
    ("an unknown field", {"model": "tiny", "prompt": "Hi", "frobnicate": 1}, 400, "frobnicate"),
    ("an empty prompt", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("token ids past the vocabulary", {"model": "tiny", "prompt": [1, 10**6]}, 400, "prompt"),
    ("two prompts", {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    ("stream_options without stream", {"model": "tiny", "prompt": "Hi", "stream_options": {}}, 400,
     "stream_options"),
    ("n true", {"model": "tiny", "prompt": "Hi", "n": True}, 400, "n"),  # true == 1 in Python, not in the API
    ("logprobs 0", {"model": "tiny", "prompt": "Hi", "logprobs": 0}, 400, "logprobs"),  # OpenAI: the sampled one's
    ("JSON nested too deeply", b"[" * 100000, 400, None),
    ("a lone surrogate", b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, "prompt"),
]
BAD_CHAT = [
    ("empty messages", {"model": "tiny", "messages": []}, 400, "messages"),
    ("a message without a role", {"model": "tiny", "messages": [{"content": "Hi"}]}, 400, "messages"),
    ("an image part", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages"),
    ("max_completion_tokens -1", {"model": "tiny", "messages": HELLO, "max_completion_tokens": -1}, 400,
     "max_completion_tokens"),
    ("max_tokens and max_completion_tokens disagreeing",
     {"model": "tiny", "messages": HELLO, "max_tokens": 3, "max_completion_tokens": 4}, 400, "max_tokens"),
    ("an unknown template option", {"model": "tiny", "messages": HELLO, "chat_template_kwargs": {"x": 1}}, 400,
     "chat_template_kwargs"),
    ("tools", {"model": "tiny", "messages": HELLO, "tools": [{"type": "function"}]}, 400, "tools"),
    ("a role the API does not have", {"model": "tiny", "messages": [{"role": "wizard", "content": "Hi"}]}, 400,
     "messages"),
    ("a lone surrogate", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages"),
]


@pytest.mark.parametrize("what, body, status, param", BAD, ids=[b[0] for b in BAD])
def test_a_bad_completion_request_gets_its_status_and_the_next_good_one_succeeds(server, what, body, status, param):
    r = server.post("/v1/completions", body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
    assert server.client.completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


@pytest.mark.parametrize("what, body, status, param", BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_a_bad_chat_request_gets_its_status(server, what, body, status, param):
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_a_role_the_openai_api_does_not_have_is_refused_naming_the_roles_it_has(server):
    wizard = {"role": "wizard", "content": "Hi"}
    r = server.post("/v1/chat/completions", {"model": "tiny", "messages": [*HELLO, wizard]})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "message 1 has the role 'wizard'; a role is one of system, developer, user, assistant, tool")


def test_a_developer_message_is_the_system_message_and_a_tool_message_reaches_the_template(server, tok):
    """OpenAI's developer role is its newer name for system, which is what chat templates know (Qwen3's leaves out
    a role it does not know): the prompt is the system message's. A tool message goes to the template as it is."""
    said = lambda role: [{"role": role, "content": "Answer briefly."}, *HELLO,
                         {"role": "assistant", "content": "Hi"}, {"role": "tool", "content": "42"}]
    r = server.client.chat.completions.create(model="tiny", messages=said("developer"), max_tokens=2)
    assert r.usage.prompt_tokens == len(tok.chat(said("system")))
    assert tok.render(said("developer")) == tok.render(said("system"))
    assert "<|im_start|>tool\n42<|im_end|>" in tok.render(said("system"))


@pytest.mark.parametrize("method, path, status, says", [
    ("POST", "/v1/embeddings", 404, "no route POST /v1/embeddings"),
    ("GET", "/v1/nothing", 404, "no route GET /v1/nothing"),
    ("GET", "/v1/chat/completions", 405, "/v1/chat/completions takes POST, not GET"),
    ("POST", "/v1/models", 405, "/v1/models takes GET, not POST"),
], ids=["unknown-route", "unknown-get", "chat-by-get", "models-by-post"])
def test_an_unknown_route_or_method_gets_openai_error_json_and_serving_goes_on(server, method, path, status, says):
    r = httpx.request(method, server.url + path, timeout=300)
    assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == {404: "not_found_error", 405: "invalid_request_error"}[status]
    assert says in error["message"] and "POST /v1/completions" in error["message"], error  # what there is
    if status == 405:
        assert method not in r.headers["allow"]
    assert server.client.completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


@pytest.mark.parametrize("name, value, message", [
    ("repetition_penalty", 1e-40, "'repetition_penalty' must be a number from 1e-30 to 1e30 (1: none), got 1e-40"),
    ("repetition_penalty", 0, "'repetition_penalty' must be a number from 1e-30 to 1e30 (1: none), got 0"),
    ("top_k", -2, "'top_k' must be an integer from -1 to 2^63 - 1 (0 or -1: no limit), got -2"),
    ("top_k", 2**70, "'top_k' must be an integer from -1 to 2^63 - 1 (0 or -1: no limit), got 1180591620717411303424"),
    ("temperature", 1e-300, "'temperature' must be 0 (greedy) or a number from 1e-6 to 2, got 1e-300"),
    ("temperature", 3, "'temperature' must be 0 (greedy) or a number from 1e-6 to 2, got 3"),
    ("top_p", 0, "'top_p' must be a number in (0, 1], got 0"),
], ids=["penalty-below-fp32", "penalty-0", "top_k--2", "top_k-past-64-bits", "temperature-0-in-fp32", "temperature-3",
        "top_p-0"])
def test_a_sampling_setting_out_of_range_is_refused_as_the_routes_own_checks_say_it(server, name, value, message):
    """The range is the engine's (any value in it runs), said in the words of every other field's refusal,
    with the field as param."""
    r = server.post("/v1/completions", {"model": "tiny", "prompt": "Hi", name: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    assert r.json()["error"]["message"] == message


def test_n_other_than_1_says_how_to_get_several_samples(server):
    r = server.post("/v1/completions", {"model": "tiny", "prompt": "Hi", "n": 3})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "'n' other than 1 is not supported by this server; for several samples send that many requests, each with "
        "its own seed")


def test_a_one_token_prompt_past_max_tokens_is_counted_in_the_singular(server):
    r = server.post("/v1/completions", {"model": "tiny", "prompt": [7], "max_tokens": 600})
    assert r.status_code == 400 and "the prompt's 1 token is past this server's context" in r.json()["error"]["message"]


def test_a_prompt_of_the_whole_context_is_refused_and_one_a_token_shorter_gets_one_token(server):
    """The tiny model's context is 512 positions: a 512-token prompt leaves no room for an answer."""
    r = server.post("/v1/completions", {"model": "tiny", "prompt": [7] * 512})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert r.json()["error"]["message"] == ("the prompt is 512 tokens, and this server's context is 512: no room "
                                            "for an answer")
    r = server.client.completions.create(model="tiny", prompt=[7] * 511, extra_body={"ignore_eos": True})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (1, "length")


def test_a_body_over_the_size_limit_gets_413(server):
    r = server.post("/v1/completions", {"model": "tiny", "prompt": "x" * (5 * 2**20)})
    assert r.status_code == 413


def test_a_stop_string_ends_the_answer_before_it(server, alone):
    text, _ = alone("The quick brown fox", 40)
    stop = text[10:13]
    cut = text[:text.index(stop)]
    r = server.client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=60, temperature=0,
                                         stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = server.client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=60,
                                                temperature=0, stop=stop, stream=True,
                                                extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert wait_until_idle(server)


def test_a_client_that_reads_slowly_does_not_hold_up_the_others(server, alone):
    """A stream nobody reads while another request is answered in full. Were the engine to wait for the
    reader, the second request would never be answered: no speed is asked of the machine, only an answer
    (the client's own 600 s timeout bounds the wait)."""
    with httpx.stream("POST", server.url + "/v1/completions", timeout=300, json={
            "model": "tiny", "prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}):
        # not reading that stream at all
        r = server.client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=20,
                                             temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == alone("The quick brown fox", 20)[0]
    assert wait_until_idle(server)


def test_sampling_settings_and_seed_are_llm_generates_and_thinking_can_be_turned_off(server, alone, tok):
    """Each setting reaches the engine: the answer is LLM.generate's with the same settings and seed, and
    leaving any one of them out changes it."""
    hot = dict(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.2, seed=7)
    ask = lambda **settings: server.client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=12, temperature=settings.pop("temperature"),
        top_p=settings.pop("top_p", None), seed=settings.pop("seed", None),
        extra_body={"ignore_eos": True, **settings}).choices[0].message.content
    want = alone(HELLO, 12, chat=True, **hot)[0]
    assert ask(**hot) == want
    for name, neutral in (("temperature", 0), ("top_p", 1.0), ("top_k", 0), ("repetition_penalty", 1.0),
                          ("seed", 8)):
        assert ask(**{**hot, name: neutral}) != want, f"{name} was not used"
    think = server.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
    no_think = server.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2,
                                                     extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    block = tok.encode("<think>\n\n</think>\n\n", False)  # the template's empty think block
    assert (think.usage.prompt_tokens, no_think.usage.prompt_tokens) == (len(tok.chat(HELLO)),
                                                                         len(tok.chat(HELLO)) + len(block))
    assert no_think.choices[0].message.content == alone(HELLO, 2, chat=True, ignore_eos=False,
                                                        chat_options={"enable_thinking": False})[0]


def test_top_k_minus_one_is_no_limit(server, alone):
    """top_k -1, documented as no limit, samples what no top_k does (the tiny model's generation_config has
    no top_k of its own), which here is not what a top-k of 1 (the greedy answer) gives."""
    ask = lambda **extra: server.client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=16, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True, **extra}).choices[0].text
    want = alone("The quick brown fox", 16, temperature=1.0, seed=3)[0]
    assert ask(top_k=-1) == ask() == want
    assert ask(top_k=1) == alone("The quick brown fox", 16)[0] != want


@pytest.fixture(scope="module")
def ends_at_eos(model_dir):
    """A one-token prompt whose greedy answer ends with EOS after a few tokens of text: (prompt ids, answer
    ids, EOS included). Found among every one-token prompt, in one batch."""
    llm = tinyflow.LLM(str(model_dir), device="cpu", compile=False)
    outs = llm.generate([[t] for t in range(llm.model.cfg.vocab_size)], max_new_tokens=12)
    found = [([t], o.token_ids) for t, o in enumerate(outs) if 3 <= len(o.token_ids) < 12]
    assert found and all(ids[-1] in llm.tokenizer.eos_ids for _, ids in found)
    return found[0]


def test_an_answer_that_ends_at_eos_finishes_with_stop(server, ends_at_eos, tok):
    """EOS ends a request normally: a 200 with finish_reason "stop", the text before EOS, and (streamed) no
    error event."""
    prompt, ids = ends_at_eos
    r = server.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (tok.decode(ids), "stop")
    assert r.json()["usage"]["completion_tokens"] == len(ids)
    events = [json.loads(line.removeprefix("data: ")) for line in server.post(
        "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
    ).text.splitlines() if line.startswith("data: {")]
    assert all("error" not in e for e in events) and events[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["text"] for e in events) == tok.decode(ids)


# ---- the text side, without a server -------------------------------------------------------------------------
def test_reasoning_goes_to_reasoning_content_and_the_answer_to_content(tok):
    think = tok.tok.token_to_id("<think>"), tok.tok.token_to_id("</think>")
    ids = [think[0]] + tok.encode("hello world", False) + [think[1]] + tok.encode("The answer is 5.", False)
    out = srv.Output(tok, set(tok.eos_ids), [], think, reasoning=False)
    pieces = [out.add([t], finished=False, max_tokens=100) for t in ids] + [out.add([], True, max_tokens=100)]
    assert out.text == {"reasoning_content": "hello world", "content": "The answer is 5."}
    for part in out.text:  # streamed, the pieces add up to the same
        assert "".join(p.get(part, "") for p in pieces) == out.text[part]
    opened = srv.Output(tok, set(), [], think, reasoning=True)  # a template that opened <think> (DeepSeek-R1)
    opened.add(tok.encode("hmm", False) + [think[1]] + tok.encode("yes", False), finished=True, max_tokens=100)
    assert opened.text == {"reasoning_content": "hmm", "content": "yes"} and opened.finish == "stop"


def test_only_the_templates_own_opening_of_the_answer_starts_it_inside_think(tok):
    """A <think> that a user writes is text, not the template opening the reasoning (as DeepSeek-R1's does)."""
    import copy
    from types import SimpleNamespace
    thinking = tok.tok.token_to_id("<think>"), tok.tok.token_to_id("</think>")
    asked = lambda t, text: srv.Server.chat_prompt(SimpleNamespace(tok=t, thinking=thinking),
                                                   {"messages": [{"role": "user", "content": text}]})[1]
    assert not asked(tok, "What does the <think> tag do?") and not asked(tok, "Hi")
    r1 = copy.copy(tok)  # a DeepSeek-R1-like template: its assistant turn opens with <think>
    r1.template = ("{% for m in messages %}<|User|>{{ m.content }}{% endfor %}"
                   "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}")
    assert asked(r1, "Hi") and asked(r1, "What does the </think> tag do?")


def test_text_stream_pieces_add_up_to_decoding_everything(tok):
    ids = tok.encode("Hello world, hello tinyflow! The quick brown fox jumps over the lazy dog.", False)
    stream = srv.TextStream(tok)
    assert "".join(stream.add([t]) for t in ids) + stream.add([], last=True) == tok.decode(ids)


def test_a_stop_string_split_across_tokens_is_held_back_until_it_is_seen(tok):
    ids = tok.encode("What is 2 + 3? The answer is 5.", False)
    out = srv.Output(tok, set(), ["answer"], None, reasoning=False)
    given = "".join(out.add([t], finished=False, max_tokens=100).get("content", "") for t in ids)
    assert given == "What is 2 + 3? The " and out.finish == "stop"
    assert out.tokens < len(ids)  # the tokens after the stop string are not counted


def test_no_part_of_a_stop_string_is_ever_given_out(tok):
    """Fed a character at a time, every prefix of the stop string " answer" is held back: what was given out
    is always text before it, until the next character shows it is not the stop string after all (then all
    of it is given out) or completes it (then none of it ever is)."""
    before, stop = "What is 2 + 3? The", " answer"
    char_ids = lambda text: [tok.encode(c, False) for c in text]
    assert all(len(ids) == 1 for ids in char_ids(before + stop + "!"))  # each character one token
    feed = lambda out, text: "".join(out.add(ids, finished=False, max_tokens=100).get("content", "")
                                     for ids in char_ids(text))
    for k in range(1, len(stop)):
        out = srv.Output(tok, set(), [stop], None, reasoning=False)
        given = feed(out, before + stop[:k])
        assert before.startswith(given), (k, given)  # nothing of the stop string's first k characters
        given += feed(out, "!") + out.add([], finished=True, max_tokens=100).get("content", "")
        assert given == before + stop[:k] + "!"  # not the stop string after all: all of it, at the end
        out = srv.Output(tok, set(), [stop], None, reasoning=False)
        given = feed(out, before + stop[:k])
        given += feed(out, stop[k:])
        assert given == before and out.finish == "stop" and out.text["content"] == before


def test_the_load_generator_sweeps_its_rates_and_reports_every_request_completed(server, tmp_path, monkeypatch,
                                                                              capsys):
    """Two rates, one load run of 12 requests each, in order; each row says how many rows were busy on average,
    and the sweep is drawn."""
    import bench  # bench.py serve, run in this process (bench.main reads sys.argv)
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    monkeypatch.setattr(sys, "argv", ["bench.py", "serve", "--url", server.url, "--requests", "12", "--rate", "50",
                                      "inf", "--prompt-len", "8", "--new-tokens", "20", "--vocab", "300", "--json",
                                      str(out), "--plot", str(png)])
    monkeypatch.setattr(bench, "ROWS", [])  # the rows a process measured: this run's alone, as in a process
    try:
        bench.main()
    except SystemExit as e:
        assert e.code == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    assert [row["rate"] for row in rows] == [50, None]  # inf is not JSON: written as null
    for row in rows:
        assert (row["requests"], row["completed"], row["new_tokens"]) == (12, 12, 20) and row["tokens_per_s"] > 0
        assert row["ttft_ms_p50_p99"] and row["tpot_ms_p50_p99"] and 0 < row["mean_busy_rows"] <= 12
        assert row["mean_busy_rows"] <= row["busy_rows_seen"] <= 12
    assert png.read_bytes().startswith(b"\x89PNG")


def test_the_busy_rows_a_request_sees_weigh_each_moment_by_the_requests_decoding_then():
    """One request alone for a second, then two together for a second: over the three request-seconds, one saw one
    busy row and two saw two (5 / 3), where the time average is 1.5."""
    import bench
    assert bench.busy_as_seen([(0.0, 2.0), (1.0, 2.0)]) == 5 / 3
    assert bench.busy_as_seen([(0.0, 1.0), (0.0, 1.0), (0.0, 1.0)]) == 3.0
    assert bench.busy_as_seen([]) == 0.0


def test_ctrl_c_with_streams_open_ends_them_and_exits_cleanly(model_dir):
    s = Running(model_dir, "--max-batch", "2", "--served-model-name", "tiny", "--max-model-len", "100000",
                "--allow-long-context", "--budget", "64")
    streams = [httpx.stream("POST", s.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "Hello", "max_tokens": 90000, "ignore_eos": True, "stream": True})
        for _ in range(4)]  # two decoding, two waiting
    lines = [r.__enter__().iter_lines() for r in streams]
    next(lines[0]), next(lines[1])
    assert s.stop() == 0
    output = s.proc.stdout.read()
    assert "Traceback" not in output, output
    for x in lines:  # decoding or still waiting: no answer that looks whole, an error event, then the end
        *_, error, done = [line for line in x if line]
        assert done == "data: [DONE]" and json.loads(error.removeprefix("data: "))["error"]["type"] == \
            "service_unavailable"


def test_a_second_ctrl_c_during_the_shutdown_is_ignored(model_dir):
    """A second SIGINT while the first one's shutdown runs (a double key press, or a signal sent to the process
    group by a wrapper as well): uvicorn would force the exit, cutting the stream mid-answer, and raise both
    signals again at the end, a traceback. Ignored, the shutdown ends the same as after one."""
    s = Running(model_dir, "--max-batch", "1", "--served-model-name", "tiny", "--budget", "64",
                "--max-model-len", "100000", "--allow-long-context")
    stream = httpx.stream("POST", s.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "Hello", "max_tokens": 90000, "ignore_eos": True, "stream": True})
    lines = stream.__enter__().iter_lines()
    next(lines)
    s.proc.send_signal(signal.SIGINT)
    time.sleep(0.02)
    assert s.stop() == 0  # the second
    output = s.proc.stdout.read()
    assert "Traceback" not in output, output
    *_, error, done = [line for line in lines if line]
    assert done == "data: [DONE]" and json.loads(error.removeprefix("data: "))["error"]["type"] == "service_unavailable"

def test_a_full_cache_server_keeps_its_free_rows_empty(checkpoints):
    """A free row that the step still runs (the busy rows rounded up to a size of its ladder) decodes junk;
    unless its cache is emptied at every sync, a full cache's row fills up and every step reads all of its
    slots. Five rows (ladder 1, 2, 4, 5), four requests: when the short one (row 0) ends, the three busy rows
    still need the step of four, so nothing moves and row 0 runs in it, free. The block launched at the sync that
    freed it decodes on top of what it held (3 + 16 + 16 slots); from the next sync on, 16 at most."""
    import generate
    from policies import resolve_policy
    from sampling import Sampling
    model, _ = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)
    engine = generate.Engine(model, compile=False)

    class Feed:  # a short request and three long ones, then the end
        given, ended = False, []

        def arrivals(self, idle):
            if not self.given:
                self.given = True
                return [([1, 2, 3], 2, set(), Sampling(), 0)] + [([1, 2], 100, set(), Sampling(), 0)] * 3
            return None if idle else []
        stopped = lambda self, i: False
        progress = lambda self, i, ids: None
        finished = lambda self, i, ids: self.ended.append(len(ids))
    feed, filled = Feed(), []
    for _ in engine.serve(feed, 5, 300, resolve_policy(None, None)):
        if engine.stepper.size == 4:
            filled.append(engine.cache.layers[0].next_slot[0, 0].item())  # the short request's row
    assert feed.ended == [2, 100, 100, 100] and len(filled) >= 6
    assert filled[1] == 3 + 2 * engine.sync_every
    assert max(filled[2:]) <= engine.sync_every  # emptied at every sync, not filling with junk


def test_a_request_that_ends_in_the_block_where_shutdown_begins_keeps_every_token(checkpoints):
    """The shutdown stops rows at the next sync; a row whose last token is in the block read there has
    ended by itself, keeps every token, and the handler is not told it was cut short."""
    import generate
    from policies import resolve_policy
    from sampling import Sampling
    model, _ = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)
    engine = generate.Engine(model, compile=False)
    limit = 1 + engine.sync_every  # the first token at prefill, the rest in the first block

    class Feed:
        given, closing, ended = False, False, []

        def arrivals(self, idle):
            if not self.given:
                self.given = True
                return [([1, 2, 3], limit, set(), Sampling(), 0)]
            return None if idle else []
        stopped = lambda self, i: self.closing
        progress = lambda self, i, ids: setattr(self, "closing", True)  # Ctrl-C after its first token
        finished = lambda self, i, ids: self.ended.append(len(ids))
    feed = Feed()
    for _ in engine.serve(feed, 1, 64, resolve_policy(None, None)):
        pass
    assert feed.ended == [limit]
