"""Soak: mixed traffic against one server for a while, checking that nothing leaks, nothing is lost, and latency
stays put.

One in-process server (the embedded model, n-gram speculation on by default, prefix caching on) and --clients
client threads, each looping over a random mix: short and long prompts, prompts sharing a long prefix (prefix-cache
hits), streamed and not, speculation on and off, and cancellations (a stream closed after its first chunks). One
request in five is a chat with JSON mode (alone or after earlier JSON replies) or logprobs; one completion in ten
asks for logprobs. A whole JSON-mode reply that ends its document must parse as a JSON object.
After every engine step the engine's pools (`LLMEngine.check_integrity()`) are checked on the engine thread; a
failure is counted and reported. RSS is sampled every second.

Reported: requests sent, completed, cancelled, failed, lost (sent minus all of those: must be 0), integrity
checks and failures, RSS after warm-up and its slope (MiB per minute, least squares over the samples after the
first --warmup seconds), and the latency percentiles (p50/p95 of whole non-streamed completions) per window of
--window seconds. One summary line, then a JSON record on the last line.

    python benchmarks/soak.py [--seconds 120] [--clients 6] [--window 30] [--warmup 20] [--key-churn]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from collections.abc import Iterable
from contextlib import ExitStack

import httpx
import numpy as np


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = self.completed = self.cancelled = self.failed = 0
        self.latencies: list[tuple[float, float]] = []  # (finish time, seconds) of non-streamed requests
        self.errors: list[str] = []

    def add(self, field: str, latency: tuple[float, float] | None = None, error: str | None = None) -> None:
        with self.lock:
            setattr(self, field, getattr(self, field) + 1)
            if latency is not None:
                self.latencies.append(latency)
            if error is not None and len(self.errors) < 20:
                self.errors.append(error)


def read_stream(lines: Iterable[str], cancel: bool) -> tuple[str, str | None]:
    """Classify one SSE completion stream: ("completed" | "cancelled" | "failed", the failure's message or None).

    Each `data:` event is parsed as JSON: the stream failed only if an event is an error object (a top-level
    "error" key, the server's mid-stream error), or it ended without `[DONE]`. With `cancel`, reading stops after
    two events and the stream counts as cancelled unless `[DONE]` was among them. (A substring test for '"error"'
    miscounted a chunk whose generated text was the token `error`, `{"text": "error", ...}`, as a failure.)"""
    events, done = 0, False
    for line in lines:
        if not line.startswith("data: "):
            continue
        events += 1
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
        else:
            try:
                payload = json.loads(data)
            except json.JSONDecodeError:
                return "failed", f"an event that is not JSON: {data[:200]!r}"
            if isinstance(payload, dict) and "error" in payload:
                return "failed", f"error event: {json.dumps(payload['error'])[:300]}"
        if cancel and events >= 2:
            break
    if cancel and not done:
        return "cancelled", None
    if done:
        return "completed", None
    return "failed", "stream ended without [DONE] and without an error event"


def _chat_body(rng: random.Random, model: str, prompt: str) -> tuple[dict, str]:
    """A chat request with one of the OpenAI features: JSON mode (alone, or after earlier JSON replies, whose
    '{}<|im_end|>' the n-gram drafter then proposes) or logprobs. Returns (body, feature)."""
    feature = rng.choice(["json", "json_after_json", "logprobs"])
    messages = [{"role": "user", "content": prompt}]
    if feature == "json_after_json":
        messages = [{"role": "user", "content": "data"}, {"role": "assistant", "content": "{}"}] * 2 + messages
    body = {"model": model, "messages": messages, "max_tokens": rng.randint(4, 48), "ignore_eos": True,
            "temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 1000), "speculative": rng.random() < 0.5}
    if feature == "logprobs":
        body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
    else:
        body["response_format"] = {"type": "json_object"}
    return body, feature


def _check_whole(response: httpx.Response, feature: str | None) -> str | None:
    """What is wrong with a non-streamed answer (None: nothing). Plain and logprobs requests run to max_tokens
    (ignore_eos); a JSON-mode reply may stop at the end of its document, and then must parse as a JSON object."""
    if response.status_code != 200:
        return f"{response.status_code}: {response.text[:200]}"
    choice = response.json()["choices"][0]
    reason = choice["finish_reason"]
    if feature in ("json", "json_after_json"):
        if reason == "stop":
            try:
                if not isinstance(json.loads(choice["message"]["content"]), dict):
                    return f"JSON mode answered a non-object: {choice['message']['content'][:200]!r}"
            except json.JSONDecodeError:
                return f"JSON mode answered text that is not JSON: {choice['message']['content'][:200]!r}"
        elif reason != "length":
            return f"finish_reason {reason!r}"
        return None
    if reason != "length":
        return f"finish_reason {reason!r}"
    if feature == "logprobs" and not (choice["logprobs"] or {}).get("content"):
        return "logprobs requested but none returned"
    if feature == "completion_logprobs" and not (choice["logprobs"] or {}).get("tokens"):
        return "logprobs requested but none returned"
    return None


def _client(url: str, model: str, stop: threading.Event, tally: Tally, seed: int, shared: str,
            key_churn: bool = False) -> None:
    rng = random.Random(seed)
    words = ["def", "return", "import", "class", "for", "while", "value", "items", "print", "self", "data"]
    with httpx.Client(base_url=url, timeout=300) as http:
        while not stop.is_set():
            kind = rng.random()
            if kind < 0.3:
                prompt = shared + " ".join(rng.choice(words) for _ in range(5))  # a prefix-cache hit
            elif kind < 0.45:
                prompt = " ".join(rng.choice(words) for _ in range(rng.randint(300, 700)))  # long
            else:
                prompt = " ".join(rng.choice(words) for _ in range(rng.randint(2, 30)))  # short
            feature: str | None = None
            if rng.random() < 0.2:  # a chat request with structured output or logprobs
                body, feature = _chat_body(rng, model, prompt)
                path = "/v1/chat/completions"
            else:
                body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(4, 48), "ignore_eos": True,
                        "temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 1000),
                        "speculative": rng.random() < 0.5}
                path = "/v1/completions"
                if rng.random() < 0.1:
                    body["logprobs"], feature = rng.randint(0, 5), "completion_logprobs"
            streamed, cancel = rng.random() < 0.5, rng.random() < 0.15
            # key churn: every request a bearer key never seen before (an open server must keep no state per key)
            headers = {"Authorization": f"Bearer sk-churn-{rng.getrandbits(64):016x}"} if key_churn else {}
            tally.add("sent")
            started = time.perf_counter()
            try:
                if streamed or cancel:
                    body["stream"] = True
                    with http.stream("POST", path, json=body, headers=headers) as response:
                        if response.status_code != 200:
                            tally.add("failed", error=f"{response.status_code}: {response.read()[:200]!r}")
                            continue
                        outcome, error = read_stream(response.iter_lines(), cancel)
                        tally.add(outcome, error=error)
                else:
                    response = http.post(path, json=body, headers=headers)
                    problem = _check_whole(response, feature)
                    if problem is not None:
                        tally.add("failed", error=f"{path} {feature or 'plain'}: {problem}")
                    elif path == "/v1/completions":  # the latency windows: completions only, as before
                        tally.add("completed", latency=(time.time(), time.perf_counter() - started))
                    else:
                        tally.add("completed")
            except httpx.HTTPError as exc:
                tally.add("failed", error=f"{type(exc).__name__}: {exc}")


def run_soak(seconds: float, clients: int = 6, window: float = 30, warmup: float = 20,
             key_churn: bool = False) -> dict:
    from k3serve.engine.config import EngineConfig
    from k3serve.engine.engine import LLMEngine
    from k3serve.engine.speculative import SpeculativeConfig
    from k3serve.loading import load_model
    from k3serve.serve.api import create_app
    from k3serve.serve.threaded import serve_in_thread

    loaded = load_model(None)
    engine = LLMEngine(loaded.model, EngineConfig(max_model_len=2048, max_seqs=32, max_batch_tokens=1024,
                                                  kv_cache_bytes=32 << 20),
                       stop_ids=loaded.stop_ids, speculative=SpeculativeConfig(drafter="ngram"))
    checks = {"steps": 0, "failures": 0, "first_failure": None}
    step = engine.step

    def checked_step():
        outputs = step()
        checks["steps"] += 1
        try:
            engine.check_integrity()
        except Exception as exc:  # noqa: BLE001 - counted and reported
            checks["failures"] += 1
            checks["first_failure"] = checks["first_failure"] or f"{type(exc).__name__}: {exc}"
        return outputs

    engine.step = checked_step
    app = create_app(engine, loaded.tokenizer, "soak")
    server = ExitStack()
    url = server.enter_context(serve_in_thread(app))
    tally, stop = Tally(), threading.Event()
    shared = "class Cache:\n    " + "def method(self, key, value):\n        return key\n    " * 40
    threads = [threading.Thread(target=_client, args=(url, "soak", stop, tally, seed, shared, key_churn))
               for seed in range(clients)]
    begin = time.time()
    for thread in threads:
        thread.start()
    rss: list[tuple[float, float]] = []
    while time.time() - begin < seconds:
        rss.append((time.time() - begin, _rss_mib()))
        time.sleep(1.0)
    stop.set()
    for thread in threads:
        thread.join(600)
    deadline = time.time() + 60
    while engine.has_unfinished_requests() and time.time() < deadline:  # aborted streams finish their abort
        time.sleep(0.1)
    server.close()
    after = [(t, m) for t, m in rss if t >= warmup] or rss
    slope = float(np.polyfit([t / 60 for t, _ in after], [m for _, m in after], 1)[0]) if len(after) > 2 else 0.0
    windows = []
    for start in np.arange(0, seconds, window):
        done = sorted(lat for t, lat in tally.latencies if start <= t - begin < start + window)
        if done:
            windows.append({"from_s": float(start), "requests": len(done), "p50_s": statistics.median(done),
                            "p95_s": done[min(len(done) - 1, int(0.95 * len(done)))]})
    lost = tally.sent - tally.completed - tally.cancelled - tally.failed
    return {"benchmark": "soak", "seconds": seconds, "clients": clients, "cpu_count": os.cpu_count(),
            "sent": tally.sent, "completed": tally.completed, "cancelled": tally.cancelled, "failed": tally.failed,
            "lost": lost, "errors": tally.errors, "integrity_checks": checks["steps"],
            "integrity_failures": checks["failures"], "first_integrity_failure": checks["first_failure"],
            "unfinished_after_drain": engine.has_unfinished_requests(),
            "rss_mib_first": rss[0][1] if rss else None, "rss_mib_after_warmup": after[0][1] if after else None,
            "rss_mib_last": rss[-1][1] if rss else None, "rss_slope_mib_per_min": slope, "key_churn": key_churn,
            "windows": windows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--window", type=float, default=30)
    parser.add_argument("--warmup", type=float, default=20)
    parser.add_argument("--key-churn", action="store_true",
                        help="every request sends a bearer key never seen before (open mode must keep no state per key)")
    args = parser.parse_args()
    record = run_soak(args.seconds, args.clients, args.window, args.warmup, args.key_churn)
    p95 = " ".join(f"{w['p95_s']:.2f}" for w in record["windows"])
    print(f"soak {args.seconds:.0f} s: {record['sent']} sent, {record['completed']} completed, "
          f"{record['cancelled']} cancelled, {record['failed']} failed, {record['lost']} lost; integrity "
          f"{record['integrity_checks']} checks, {record['integrity_failures']} failures; RSS "
          f"{record['rss_mib_after_warmup']:.0f} -> {record['rss_mib_last']:.0f} MiB "
          f"({record['rss_slope_mib_per_min']:+.2f} MiB/min, "
          f"{100 * (record['rss_mib_last'] / record['rss_mib_after_warmup'] - 1):+.1f}%)"
          f"{' with key churn' if args.key_churn else ''}; p95 per window {p95} s")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
