"""--trace-out on a full disk (issue 32, item 4): tracing stops with one warning and counts what it dropped; the
tokens, and every request, are those of an untraced run. Tools whose output is the trace still fail."""

from __future__ import annotations

import errno
import logging

import httpx
import pytest

from k3serve.stream.trace import TraceWriter, read_trace

FULL_AFTER_WRITES = 5  # the disk fills after this many trace writes (a few layers into the first forward)


class _FillingFile:
    """A trace file whose disk fills after `allowed` writes: every later write or flush raises ENOSPC."""

    def __init__(self, inner, allowed: int) -> None:
        self.inner = inner
        self.allowed = allowed
        self.full = False

    def write(self, data: bytes) -> int:
        if self.allowed == 0:
            self.full = True
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.allowed -= 1
        return self.inner.write(data)

    def flush(self) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def filling_disk(monkeypatch):
    """Every TraceWriter made while it is active writes to a disk that fills; yields the writers."""
    writers: list[TraceWriter] = []
    real_init = TraceWriter.__init__

    def init(self, *args, **kwargs) -> None:
        real_init(self, *args, **kwargs)
        self._file = _FillingFile(self._file, FULL_AFTER_WRITES)
        writers.append(self)

    monkeypatch.setattr(TraceWriter, "__init__", init)
    return writers


def _one_warning(caplog, path) -> None:
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "trace" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert str(path) in warnings[0] and "No space left on device" in warnings[0]


def _check_stopped(writer: TraceWriter, path) -> None:
    assert writer.error is not None and writer.error.errno == errno.ENOSPC
    assert writer.num_records > 0 and writer.dropped_records > 0
    assert len(read_trace(path).records) == writer.num_records  # cut back to whole records: still readable


def test_generate_on_a_full_disk_keeps_its_tokens_and_counts_the_dropped_records(tmp_path, capsys, caplog,
                                                                                   filling_disk):
    from k3serve.cli.main import main

    argv = ["generate", "--prompt-ids", "1,5,9,200,17", "--max-tokens", "10", "--ignore-eos"]
    assert main(argv) == 0
    untraced = capsys.readouterr().out
    path = tmp_path / "r.trace"
    with caplog.at_level(logging.WARNING):
        assert main(argv + ["--trace-out", str(path)]) == 0
    assert capsys.readouterr().out == untraced
    (writer,) = filling_disk
    _check_stopped(writer, path)
    _one_warning(caplog, path)
    records_per_token = writer.num_records + writer.dropped_records
    writer.write(99, 0, 0, [[1, 2]])  # after the stop: counted, never written
    assert writer.dropped_records + writer.num_records == records_per_token + 1


def test_a_streamed_model_on_a_full_disk_keeps_its_tokens(tiny_store, tmp_path, caplog, filling_disk):
    from k3serve.loading import load_model
    from k3serve.stream.options import StreamOptions

    prompt = [1, 5, 9, 200, 17]
    plain = load_model(tiny_store.path, stream=StreamOptions())
    expected = plain.model.greedy(prompt, 12)
    plain.model.source.close()
    path = tmp_path / "r.trace"
    traced = load_model(tiny_store.path, stream=StreamOptions(trace_out=path))
    with caplog.at_level(logging.WARNING):
        assert traced.model.greedy(prompt, 12) == expected
        traced.model.source.close()
    (writer,) = filling_disk
    _check_stopped(writer, path)
    _one_warning(caplog, path)


def test_serve_on_a_full_disk_answers_every_request(tmp_path, caplog, filling_disk):
    from k3serve.engine.config import EngineConfig
    from k3serve.engine.engine import LLMEngine
    from k3serve.loading import load_model
    from k3serve.loading.k3 import record_routing
    from k3serve.serve.api import create_app
    from k3serve.serve.threaded import serve_in_thread

    prompts = ["def add(a, b):", "import os", "The cat", "for i in range(", "class Stack:", "# sort a list"]
    loaded = load_model(None)
    config = EngineConfig(max_model_len=256, max_seqs=8, max_batch_tokens=512, kv_cache_bytes=32 << 20)

    def complete_all() -> list[str]:
        engine = LLMEngine(loaded.model, config, stop_ids=loaded.stop_ids)
        texts = []
        with serve_in_thread(create_app(engine, loaded.tokenizer, "k3-test")) as url:
            for prompt in prompts:  # one at a time: the same batches with and without the trace
                response = httpx.post(url + "/v1/completions", timeout=120, json={
                    "model": "k3-test", "prompt": prompt, "max_tokens": 6, "temperature": 0})
                assert response.status_code == 200, response.text
                texts.append(response.json()["choices"][0]["text"])
        return texts

    untraced = complete_all()
    path = tmp_path / "serve.trace"
    record_routing(loaded.model, path)
    with caplog.at_level(logging.WARNING):
        assert complete_all() == untraced
    assert not path.exists()  # written beside its name until the trace closes (at the server's exit)
    loaded.model.source.close()
    (writer,) = filling_disk
    _check_stopped(writer, path)
    _one_warning(caplog, path)


def test_a_tool_whose_output_is_the_trace_still_fails_on_a_full_disk(tmp_path):
    writer = TraceWriter(tmp_path / "r.trace", {"num_experts": 4, "top_k": 2})
    writer._file = _FillingFile(writer._file, 0)
    with pytest.raises(OSError) as info:
        writer.write(0, 0, 0, [[1, 2]])
    assert info.value.errno == errno.ENOSPC


def test_a_trace_out_is_whole_or_absent_under_its_name(tmp_path):
    """--trace-out is written beside its name and renamed when it closes: a process killed while tracing leaves no
    file under the name (only its temporary file); a closed trace is whole."""
    import os
    import subprocess
    import sys

    meta = {"num_layers": 2, "num_experts": 8, "top_k": 2}
    killed = tmp_path / "killed.trace"
    code = ("import os, signal\nfrom k3serve.stream.trace import TraceWriter\n"
            f"writer = TraceWriter({str(killed)!r}, {meta!r}, best_effort=True)\n"
            "writer.write(0, 0, 1, [[1, 2], [3, 4]])\nos.kill(os.getpid(), signal.SIGKILL)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, env=os.environ.copy())
    assert result.returncode == -9, result.stderr
    assert not killed.exists()
    assert [p.name.startswith(".killed.trace.") and p.name.endswith(".tmp") for p in tmp_path.iterdir()] == [True]

    path = tmp_path / "r.trace"
    writer = TraceWriter(path, meta, best_effort=True)
    writer.write(0, 0, 1, [[1, 2], [3, 4]])
    assert not path.exists()
    writer.close()
    assert read_trace(path).records == [(0, 0, 1, (1, 2)), (0, 1, 1, (3, 4))]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".r.trace")) == []
