"""`python -m registry.integrations.server` (mlx-aot-server): mlx-lm's OpenAI-compatible server with
the drop-in caches. A real server on a free loopback port answers chat and text completions
(streamed too), batched and one at a time, and reuses its prompt cache; every token is stock
mlx-lm's (float32, greedy), and its log shows the fused kernel running for every request. Then the
hook itself, in-process, and clear errors."""

from __future__ import annotations

import importlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import mlx.core as mx
import pytest

from registry.integrations import mlx_lm_cache as mc
from registry.integrations import server
from registry.integrations.mlx_lm import import_mlx_lm_module
from tests._model_dir import write_model_dir

gen = importlib.import_module("mlx_lm.generate")
stock = import_mlx_lm_module("cache")
TIMEOUT = 60          # seconds, for the server to start and for each request
MAX_TOKENS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(port: int, path: str, body: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def served(native_artifacts, tmp_path_factory):
    """(port, model dir, log file) of a server started for this module, always stopped."""
    d = write_model_dir(tmp_path_factory.mktemp("model"), "qwen3", seed=0)
    log = d.parent / "server.log"
    port = _free_port()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "registry.integrations.server", "--model", str(d),
                                 "--host", "127.0.0.1", "--port", str(port), "--max-tokens", str(MAX_TOKENS)],
                                stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ),
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                if _request(port, "/health")[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server did not start (exit {proc.poll()}):\n{log.read_text()}")
            time.sleep(0.2)
        yield port, d, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def reference(served):
    """Stock mlx-lm on the same directory: greedy tokens (through the first EOS) and text per prompt."""
    utils = importlib.import_module("mlx_lm.utils")
    model, tok = utils.load(str(served[1]))

    def tokens(prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
        out = []
        for (t, _), _ in zip(gen.generate_step(mx.array(prompt), model, max_tokens=n,
                                               prompt_cache=stock.make_prompt_cache(model)), range(n)):
            out.append(t)
            if t in tok.eos_token_ids:
                break
        return out

    def text(prompt: list[int]) -> str:
        return gen.generate(model, tok, prompt, max_tokens=MAX_TOKENS, prompt_cache=stock.make_prompt_cache(model))

    def chat(messages: list[dict]) -> list[int]:
        return list(tok.apply_chat_template(messages, add_generation_prompt=True))

    return SimpleNamespace(tokens=tokens, text=text, chat=chat, encode=tok.encode)


def _completion(port, path, body) -> dict:
    status, raw = _request(port, path, {"max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": True, **body})
    assert status == 200, raw
    return json.loads(raw)


def _ids(resp) -> list[int]:
    return [c["id"] for c in resp["choices"][0]["logprobs"]["content"]]


def _calls_so_far(log) -> list[int]:
    return [int(n) for n in re.findall(r"fused kernel calls so far: (\d+)", log.read_text())]


def test_server_answers_as_stock_mlx_lm_with_prompt_cache_reuse(served, reference):
    port, _, log = served
    chat = [{"role": "user", "content": "hello world"}]
    # 1. chat, batched (BatchGenerator): a fresh drop-in cache
    r = _completion(port, "/v1/chat/completions", {"messages": chat})
    want = reference.tokens(reference.chat(chat))
    assert _ids(r) == want and len(set(want)) >= 3, (_ids(r), want)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    answer = r["choices"][0]["message"]["content"]
    assert answer == reference.text(reference.chat(chat))

    # 2. the same chat, streamed: its prompt is a prefix of request 1's cached tokens
    status, raw = _request(port, "/v1/chat/completions", {"messages": chat, "stream": True, "temperature": 0.0,
                                                          "max_tokens": MAX_TOKENS})
    assert status == 200
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == answer

    # 3. the conversation continued: shares request 1's prompt and answer
    chat2 = chat + [{"role": "assistant", "content": answer}, {"role": "user", "content": "the a of"}]
    r = _completion(port, "/v1/chat/completions", {"messages": chat2})
    assert _ids(r) == reference.tokens(reference.chat(chat2))
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(reference.chat(chat))

    # 4. text completion, then 5. one sharing its prompt with a seed: served one at a time (_serve_single)
    text = "hello world the a"
    r = _completion(port, "/v1/completions", {"prompt": text})
    assert _ids(r) == reference.tokens(reference.encode(text))
    r = _completion(port, "/v1/completions", {"prompt": text + " of to", "seed": 0})
    assert _ids(r) == reference.tokens(reference.encode(text + " of to"))
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(reference.encode(text)) - 1
    # 6. a last request, so the log has counted request 5's kernel calls
    _completion(port, "/v1/completions", {"prompt": "it is", "max_tokens": 1})

    assert re.search(r"mlx-aot drop-in caches for .*:\nlayers 0-1: fused: qk_norm_rope_pool_fused \(native-",
                     log.read_text())
    calls = _calls_so_far(log)
    assert len(calls) == 6 and all(b > a for a, b in zip(calls, calls[1:])), calls   # every request ran fused


# ----------------------------------------------------------------------------- the hook, in-process

def _provider(model, draft=None):
    return SimpleNamespace(model=model, model_key=("m", None, None), draft_model=draft)


def test_drop_in_prompt_cache_misses_are_fused_and_hits_stay_fused(native_artifacts, tmp_path):
    utils = importlib.import_module("mlx_lm.utils")
    model, _ = utils.load(str(write_model_dir(tmp_path, "qwen3", seed=0)))
    lru = server.DropInPromptCache(_provider(model))
    assert lru.fetch_nearest_cache(("other", None, None), [1, 2, 3]) == (None, [1, 2, 3])   # not the loaded model
    prompt = [5, 6, 7, 8, 9]
    cache, rest = lru.fetch_nearest_cache(("m", None, None), prompt)
    assert rest == prompt and all(type(c) is mc.KVCache for c in cache)
    toks = [t for (t, _), _ in zip(gen.generate_step(mx.array(prompt), model, max_tokens=4, prompt_cache=cache),
                                   range(4))]
    assert cache[0].offset == len(prompt + toks)     # generate_step ran the step after the last token
    lru.insert_cache(("m", None, None), prompt + toks, cache)
    longer = prompt + toks + [10, 11]
    fm = mc.fused_model(model)
    before = sum(f.calls["fused"] for f in fm.fusions.values())
    hit, rest = lru.fetch_nearest_cache(("m", None, None), longer)
    assert rest == [10, 11] and all(type(c) is mc.KVCache for c in hit) and hit[0] is not cache[0]
    got = [t for (t, _), _ in zip(gen.generate_step(mx.array(rest), model, max_tokens=5, prompt_cache=hit), range(5))]
    want = [t for (t, _), _ in zip(gen.generate_step(mx.array(longer), model, max_tokens=5,
                                                     prompt_cache=stock.make_prompt_cache(model)), range(5))]
    assert got == want and sum(f.calls["fused"] for f in fm.fusions.values()) > before


def test_draft_model_gets_its_caches_too(native_artifacts, tmp_path):
    """Speculative decoding (served one at a time): the cache list holds the model's then the
    draft's, as mlx-lm's _serve_single makes it, and gives stock's tokens."""
    utils = importlib.import_module("mlx_lm.utils")
    model, tok = utils.load(str(write_model_dir(tmp_path / "a", "qwen3", seed=0)))
    draft, _ = utils.load(str(write_model_dir(tmp_path / "b", "qwen3", seed=1)))
    cache, _ = server.DropInPromptCache(_provider(model, draft)).fetch_nearest_cache(("m", None, None), [5, 6, 7])
    assert len(cache) == 4 and all(type(c) is mc.KVCache for c in cache)

    def speculate(c):
        return [r.token for r in gen.stream_generate(model, tok, [5, 6, 7], max_tokens=6, draft_model=draft,
                                                     num_draft_tokens=2, prompt_cache=c)]

    assert speculate(cache) == speculate(stock.make_prompt_cache(model) + stock.make_prompt_cache(draft))


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("case, expect", [
    ("missing", "no such directory, and not a Hugging Face repo id (owner/name)"),
    ("file", "not a directory"),
    ("no_config", "no config.json"),
])
def test_bad_model_is_a_clear_error(tmp_path, capsys, case, expect):
    target = {"missing": tmp_path / "nope" / "x", "file": tmp_path / "f", "no_config": tmp_path}[case]
    if case == "file":
        target.write_text("")
    assert server.main(["--model", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(target) in err
    assert expect in err and "Traceback" not in err, err


def test_bad_flag_is_mlx_lms_usage_error_and_nothing_stays_replaced(capsys):
    mlx_server = importlib.import_module("mlx_lm.server")
    run, argv = mlx_server.run, sys.argv
    with pytest.raises(SystemExit) as e:
        server.main(["--port", "eighty"])
    assert e.value.code == 2 and "argument --port: invalid int value: 'eighty'" in capsys.readouterr().err
    assert mlx_server.run is run and sys.argv is argv


def test_port_in_use_is_a_clear_error(native_artifacts, tmp_path, capsys):
    d = write_model_dir(tmp_path, "qwen3", seed=0)
    mlx_server = importlib.import_module("mlx_lm.server")
    run = mlx_server.run
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert server.main(["--model", str(d), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"error: --host 127.0.0.1 --port {port}: cannot listen there" in err and "Traceback" not in err, err
    assert mlx_server.run is run
