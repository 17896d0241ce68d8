"""The command line, run as a user would: generate on the embedded model, logits, make-tiny, errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from k3serve.cli.main import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3serve.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_on_the_embedded_model_streams_text_and_reports_on_stderr():
    result = _run("generate", "--prompt", "def fibonacci(n):", "--max-tokens", "12", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "generated text goes to stdout"
    for field in ("prompt tokens", "generated tokens  12", "prefill", "decode", "peak RSS"):
        assert field in result.stderr
    assert "prompt tokens" not in result.stdout  # the report never pollutes piped output


def test_generate_is_deterministic_with_a_seed(capsys):
    outputs = []
    for _ in range(2):
        assert main(["generate", "--prompt", "import os", "--max-tokens", "10", "--temperature", "0.9",
                     "--top-p", "0.9", "--seed", "7", "--ignore-eos"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]


def test_logits_full_and_incremental_agree(tiny_dir, tmp_path):
    ids = "1,5,9,200,17,3,88,41,2,250,7"
    paths = {}
    for mode in ("full", "incremental"):
        paths[mode] = tmp_path / f"{mode}.npy"
        assert main(["logits", "--model", str(tiny_dir), "--ids", ids, "--out", str(paths[mode]),
                     "--mode", mode]) == 0
    full, incremental = np.load(paths["full"]), np.load(paths["incremental"])
    assert full.dtype == np.float32 and full.shape == (11, 256)
    assert np.array_equal(full.argmax(1), incremental.argmax(1))
    # float32 summation order differs between a prefill and decode steps (MLA, matmuls): tests/model/test_k3.py's
    # SAME_FUNCTION_RTOL bound (measured 1.0e-5 here; the KDA recurrence itself gives the same bits both ways)
    assert np.sqrt(np.mean((full - incremental) ** 2) / np.mean(full ** 2)) < 5e-5


def test_make_tiny_writes_a_loadable_oracle(tmp_path):
    from k3serve.weights.checkpoint import Checkpoint

    assert main(["make-tiny", str(tmp_path / "t")]) == 0
    with Checkpoint(tmp_path / "t") as checkpoint:
        assert checkpoint.config.layer_map == "KKKMKKKMKKKMM"
        assert checkpoint.index.info("language_model.model.embed_tokens.weight").dtype == "BF16"
        expert = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
        assert checkpoint.index.info(expert).dtype == "U8"
        assert len(list(checkpoint.path.glob("*.safetensors"))) > 1  # sharded, with an index


def test_user_errors_exit_2_with_a_message(tiny_dir, tmp_path):
    result = _run("logits", "--model", str(tiny_dir), "--ids", "1,2,999", "--out", str(tmp_path / "x.npy"))
    assert result.returncode == 2 and "out of range" in result.stderr
    result = _run("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi")
    assert result.returncode == 2 and "does not exist" in result.stderr
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    result = _run("generate", "--model", str(gguf), "--prompt", "hi")
    assert result.returncode == 2 and "is not a readable GGUF file" in result.stderr
    plain_file = tmp_path / "weights.bin"
    plain_file.write_bytes(b"\x00" * 8)
    result = _run("generate", "--model", str(plain_file), "--prompt", "hi")
    assert result.returncode == 2 and "is a file, not a checkpoint folder" in result.stderr
    result = _run("generate", "--prompt", "hi", "--temperature", "-1")
    assert result.returncode == 2 and "temperature" in result.stderr
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for file in tiny_dir.iterdir():
        data = file.read_bytes()
        (truncated / file.name).write_bytes(data[: len(data) // 2] if file.suffix == ".safetensors" else data)
    result = _run("logits", "--model", str(truncated), "--ids", "1", "--out", str(tmp_path / "y.npy"))
    assert result.returncode == 2 and "safetensors" in result.stderr


def test_prompts_past_the_context_are_refused_by_generate_and_logits(tiny_dir, tmp_path, capsys):
    ids = ",".join(["5"] * 5000)  # past the default 4096, as the server counts it
    expected = "k3serve: error: this model's context holds 4096 tokens, but the prompt has 5000"
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", ids, "--max-tokens", "4"]) == 2
    assert expected + " and --max-tokens asks for 4 more" in capsys.readouterr().err  # the flag, as typed
    assert main(["logits", "--model", str(tiny_dir), "--ids", ids, "--out", str(tmp_path / "l.npy")]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "l.npy").exists()
    # a larger context is the user's choice
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "5,6,7", "--max-tokens", "4",
                 "--max-model-len", "6"]) == 2
    assert "context holds 6 tokens, but the prompt has 3 and --max-tokens asks for 4 more" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "cluster"])
def test_serve_and_cluster_pass_the_prefix_cache_policy_to_the_engine(command, capsys):
    from k3serve.cli.main import _engine_config, build_parser

    parser = build_parser()
    assert _engine_config(parser.parse_args([command])).prefix_cache_policy == "slru"
    assert _engine_config(parser.parse_args([command, "--prefix-cache-policy", "lru"])).prefix_cache_policy == "lru"
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([command, "--prefix-cache-policy", "lfu"])
    assert exit_info.value.code == 2 and "--prefix-cache-policy" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "cluster"])
def test_serve_and_cluster_size_the_state_checkpoints(command, capsys):
    from k3serve.cli.main import _engine_config, build_parser
    from k3serve.engine.config import EngineConfig

    parser = build_parser()
    default = _engine_config(parser.parse_args([command]))
    assert (default.num_state_checkpoints, default.checkpoint_every_blocks) == (
        EngineConfig.num_state_checkpoints, EngineConfig.checkpoint_every_blocks)
    config = _engine_config(parser.parse_args([command, "--state-checkpoints", "8", "--checkpoint-every-blocks", "4"]))
    assert (config.num_state_checkpoints, config.checkpoint_every_blocks) == (8, 4)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([command, "--state-checkpoints", "-1"])
    assert exit_info.value.code == 2 and "--state-checkpoints" in capsys.readouterr().err
    assert default.prefix_wait_tokens == EngineConfig.prefix_wait_tokens
    assert _engine_config(parser.parse_args([command, "--prefix-wait-tokens", "0"])).prefix_wait_tokens == 0


def test_serve_passes_the_disk_tier_and_the_io_charge_to_the_engine(tmp_path):
    from k3serve.cli.main import _engine_config, build_parser
    from k3serve.errors import UsageError

    parser = build_parser()
    config = _engine_config(parser.parse_args(["serve", "--prefix-cache-dir", str(tmp_path), "--prefix-cache-disk",
                                               "2G", "--charge", "io", "--io-cost", "250"]))
    assert (config.prefix_cache_dir, config.prefix_cache_disk_bytes) == (str(tmp_path), 2 << 30)
    assert (config.charge, config.io_cost) == ("io", 250.0)
    default = _engine_config(parser.parse_args(["serve"]))
    assert (default.prefix_cache_dir, default.charge) == (None, "tokens")
    for flags, named in ((["--prefix-cache-dir", str(tmp_path)], "--prefix-cache-disk"),
                         (["--prefix-cache-disk", "1G"], "--prefix-cache-dir"),
                         (["--prefix-cache-dir", str(tmp_path), "--prefix-cache-disk", "1G", "--no-prefix-cache"],
                          "--no-prefix-cache"),
                         (["--charge", "io", "--scheduling", "fcfs"], "--scheduling fair"),
                         (["--defer-io-heavy"], "--charge io")):
        with pytest.raises(UsageError, match=named):
            _engine_config(parser.parse_args(["serve", *flags]))
    isolated = _engine_config(parser.parse_args(["serve", "--charge", "io", "--tenant-cache-shares",
                                                 "--defer-io-heavy", "--io-heavy-step-tokens", "16"]))
    assert (isolated.tenant_cache_shares, isolated.defer_io_heavy, isolated.io_heavy_step_tokens) == (True, True, 16)
    assert (default.tenant_cache_shares, default.defer_io_heavy) == (False, False)


@pytest.mark.parametrize("content", [b"", b"\x00\x17random bytes, not the GGUF magic" * 40])
def test_an_empty_or_random_gguf_file_is_not_a_valid_gguf_file(tmp_path, capsys, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    for argv in (["generate", "--model", str(path), "--prompt-ids", "1"], ["info", "--model", str(path)],
                 ["pack", str(path), str(tmp_path / "out")]):
        with pytest.raises(SystemExit) as exit_info:  # a bad argument: the parser's one line and exit 2
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"{path} is not a valid GGUF file" in err and "is a GGUF file" not in err, err


def test_a_missing_gguf_file_is_not_called_a_checkpoint_folder(tmp_path, capsys):
    from k3serve.errors import CheckpointError
    from k3serve.weights.checkpoint import Checkpoint

    path = tmp_path / "x.gguf"
    with pytest.raises(SystemExit) as exit_info:
        main(["logits", "--model", str(path), "--ids", "1", "--out", str(tmp_path / "l.npy")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"GGUF file {path} does not exist" in err and "checkpoint folder" not in err
    with pytest.raises(CheckpointError, match="GGUF file .* does not exist"):
        Checkpoint(path)


# --- issue 32, item 20: a full disk names the path, and outputs are whole or absent

def _full_disk(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")  # what a write() on a full disk raises: no file name


def _left_in(folder):
    return sorted(p.name for p in folder.iterdir())


def test_logits_on_a_full_disk_names_the_path_and_leaves_no_file(tiny_dir, tmp_path, capsys, monkeypatch):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "l.npy"

    def save_half_then_fail(file, array, *args, **kwargs):
        file.write(b"\x93NUMPY partial")
        _full_disk()

    monkeypatch.setattr(np, "save", save_half_then_fail)
    assert main(["logits", "--model", str(tiny_dir), "--ids", "1,5,9", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"k3serve: error: {out}: No space left on device\n"
    assert _left_in(out_dir) == []  # neither the output nor its temporary file


def test_logits_out_in_a_folder_that_does_not_exist_is_refused_and_nothing_is_made(tmp_path, capsys):
    out = tmp_path / "new" / "dir" / "l.npy"
    with pytest.raises(SystemExit) as exit_info:
        main(["logits", "--ids", "1", "--out", str(out)])
    assert exit_info.value.code == 2
    assert "--out" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_routing_stats_on_a_full_disk_names_the_trace_and_leaves_no_file(tmp_path, capsys, monkeypatch):
    from k3serve.stream.trace import TraceWriter

    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 20)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    trace = out_dir / "r.trace"
    monkeypatch.setattr(TraceWriter, "write", _full_disk)
    assert main(["routing-stats", "--text", str(text), "--tokens", "32", "--window", "16",
                 "--trace-out", str(trace)]) == 2
    assert f"k3serve: error: {trace}: No space left on device" in capsys.readouterr().err
    assert _left_in(out_dir) == []


def test_pack_on_a_full_disk_names_the_output_and_leaves_no_folder(tiny_dir, tmp_path, capsys, monkeypatch):
    import k3serve.weights.pack

    monkeypatch.setattr(k3serve.weights.pack, "expert_blob", _full_disk)
    out = tmp_path / "packed"
    assert main(["pack", str(tiny_dir), str(out)]) == 2
    assert capsys.readouterr().err.endswith(f"\nk3serve: error: {out}: No space left on device\n")
    assert _left_in(tmp_path) == []  # no half store, no staging folder


def test_coactivation_on_a_full_disk_leaves_no_torn_npy_or_png(tmp_path, capsys, monkeypatch):
    import k3serve.cli.heatmap
    from k3serve.stream.trace import TraceWriter

    trace = tmp_path / "r.trace"
    writer = TraceWriter(trace, {"num_layers": 3, "num_experts": 8, "top_k": 2})
    for token in range(6):
        writer.write(token, token, 1, [[token % 8, (token + 3) % 8]])
    writer.close()
    out = tmp_path / "maps"
    real_save = np.save

    def save_half_then_fail(file, array, *args, **kwargs):
        file.write(b"\x93NUMPY partial")
        _full_disk()

    monkeypatch.setattr(np, "save", save_half_then_fail)
    assert main(["coactivation", str(trace), "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"k3serve: error: {out / 'layer_001.npy'}: No space left on device\n"
    assert _left_in(out) == []  # neither the .npy nor its temporary file

    def png_half_then_fail(path, rgb):
        open(path, "wb").write(b"\x89PNG partial")
        _full_disk()

    monkeypatch.setattr(np, "save", real_save)
    monkeypatch.setattr(k3serve.cli.heatmap, "write_png", png_half_then_fail)
    assert main(["coactivation", str(trace), "--out", str(out)]) == 2
    assert f"{out / 'layer_001.png'}: No space left on device" in capsys.readouterr().err
    assert _left_in(out) == ["layer_001.npy"]  # the whole .npy written before the disk filled; no torn .png
    assert np.load(out / "layer_001.npy").shape == (8, 8)


def test_first_use_packing_removes_the_staging_folders_of_killed_packers(tmp_path, monkeypatch):
    import os

    from k3serve.loading.streaming import default_packed_dir

    monkeypatch.setenv("K3SERVE_CACHE", str(tmp_path))
    models = tmp_path / "models"
    dead, unnamed, live = (models / ".staging-999999999-ab12", models / ".staging-xy34",
                           models / f".staging-{os.getpid()}-cd56")  # 999999999: above any Linux pid_max
    for folder in (dead, unnamed, live):
        folder.mkdir(parents=True)
        (folder / "trunk.bin").write_bytes(b"half")
    target = default_packed_dir()
    assert not dead.exists() and not unnamed.exists()
    assert live.exists()  # a packer still running keeps its folder
    assert (target / "store.json").exists()


# --- issue 32, item 21: flags that do not go together are a clear error or one warning

def _parse_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_info_full_k3_with_a_model_is_refused(tmp_path, capsys):
    assert main(["info", "--full-k3", "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3serve: error: --full-k3") and "--model" in err


def test_step_interruption_under_fcfs_scheduling_is_refused(capsys):
    assert main(["serve", "--scheduling", "fcfs", "--step-interruption"]) == 2
    err = capsys.readouterr().err
    assert "--step-interruption" in err and "--scheduling fair or priority" in err


@pytest.mark.parametrize("name", ["", "   "])
def test_an_empty_served_model_name_is_refused(capsys, name):
    assert "argument --served-model-name: must not be empty" in _parse_error(
        ["serve", "--served-model-name", name], capsys)


def test_pack_over_an_existing_store_is_refused_and_the_store_is_kept(tiny_dir, tiny_store, capsys):
    before = sorted((p.name, p.stat().st_size) for p in tiny_store.path.iterdir())
    assert main(["pack", str(tiny_dir), str(tiny_store.path)]) == 2
    assert f"{tiny_store.path} already holds a packed store" in capsys.readouterr().err
    assert sorted((p.name, p.stat().st_size) for p in tiny_store.path.iterdir()) == before


def test_next_layer_prefetch_without_a_slot_to_prefetch_into_warns_once(tiny_store, tmp_path, caplog):
    from k3serve.stream.budget import minimum_budget_bytes

    minimum = minimum_budget_bytes(tiny_store)  # exactly top-k expert slots: all taken by the running layer
    roomy = minimum + 2 * tiny_store.config.num_experts_per_token * tiny_store.expert_stride
    for budget, warned in ((minimum, True), (roomy, False)):
        caplog.clear()
        assert main(["logits", "--model", str(tiny_store.path), "--ids", "1,5,9", "--out", str(tmp_path / "l.npy"),
                     "--ram-budget", str(budget), "--prefetch", "next-layer", "--trunk-dtype", "float32"]) == 0
        messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "prefetch" in
                    r.getMessage()]
        assert len(messages) == (1 if warned else 0), (budget, messages)
        if warned:
            assert "no guess has a slot" in messages[0] and "--ram-budget" in messages[0]


def test_lab_on_a_checkpoint_without_a_tokenizer_is_refused_at_start(tiny_dir, capsys):
    assert main(["lab", "--model", str(tiny_dir)]) == 2
    err = capsys.readouterr().err
    assert f"--model {tiny_dir} has no tokenizer" in err and "the lab is on" not in err


# --- issue 32, item 22: errors speak in flags, and say what is true

def test_sim_c_engine_without_its_split_names_the_flags(capsys):
    assert main(["sim", "k3", "--engine", "c-engine"]) == 2
    err = capsys.readouterr().err
    assert "--c-pinned and --c-cache" in err and "needs pinned_layers and cache_bytes" not in err


def test_sim_k3_below_the_float32_floor_points_to_the_bf16_trunk_and_the_floors(capsys):
    assert main(["sim", "k3", "--ram", "8G", "--trunk-dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "--trunk-dtype bf16 runs from 1.58 GiB" in err and "docs/SIMULATOR.md" in err


def test_sim_k3_runs_the_full_k3_in_2_gib(capsys):
    assert main(["sim", "k3", "--ram", "2G", "--machine", "c-engine-v1", "--tokens", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "0/93 trunk layers pinned" in out and "time/token" in out


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_step_interruption_on_a_traced_model_names_the_flag(tmp_path, capsys):
    assert main(["serve", "--step-interruption", "--trace-out", str(tmp_path / "r.trace"), "--port",
                 str(_free_port())]) == 2
    err = capsys.readouterr().err
    assert "k3serve: error: --step-interruption needs" in err and "step_interruption" not in err


def test_trace_out_is_not_listed_as_needing_a_packed_store(tiny_dir, tmp_path, capsys):
    from k3serve.cli.main import build_parser

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["generate"].format_help().split())
    assert "any of these but --trace-out reads the model from a packed store" in help_text
    assert main(["logits", "--model", str(tiny_dir), "--ids", "1", "--out", str(tmp_path / "l.npy"),
                 "--ram-budget", "2M", "--trace-out", str(tmp_path / "r.trace")]) == 2
    err = capsys.readouterr().err
    assert "--ram-budget reads a packed store" in err and "--prefetch, --trace-out) read" not in err


def test_prompt_ids_out_of_range_name_the_id_and_the_flag(tiny_dir, tmp_path, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,99999999", "--max-tokens", "1"]) == 2
    assert "--prompt-ids: token id 99999999 (number 2 in the list) is out of range: this model's vocabulary is 0..255" \
        in capsys.readouterr().err
    assert main(["logits", "--model", str(tiny_dir), "--ids", "300", "--out", str(tmp_path / "l.npy")]) == 2
    assert "--ids: token id 300 (number 1 in the list)" in capsys.readouterr().err


# --- issue 32, item 24: affordances

def test_generate_reads_the_prompt_from_a_file_or_stdin_as_the_same_text(tmp_path, capsys, monkeypatch):
    import io

    text = "def fibonacci(n):\n    "
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(text)
    outputs = []
    for source in (["--prompt", text], ["--prompt-file", str(prompt_file)], ["--prompt-file", "-"]):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
        assert main(["generate", *source, "--max-tokens", "8", "--ignore-eos"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0].strip() and outputs[0] == outputs[1] == outputs[2]


def test_a_missing_or_binary_prompt_file_is_named_before_the_model_loads(tmp_path, capsys):
    binary = tmp_path / "prompt.bin"
    binary.write_bytes(b"\xff\xfe\x00 not utf-8")
    for path, says in ((tmp_path / "missing.txt", "No such file"), (binary, "is not UTF-8 text")):
        assert main(["generate", "--model", str(tmp_path / "no-model"), "--prompt-file", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"--prompt-file {path}" in err and says in err and "no-model" not in err, err


def test_routing_stats_reports_its_progress_on_stderr(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return [x * i for i in range(10)]\n" * 20)
    assert main(["routing-stats", "--text", str(text), "--tokens", "32", "--window", "16"]) == 0
    err = capsys.readouterr().err
    assert "[ 50.0%] routed 16 of 32 tokens" in err and "[100.0%] routed 32 of 32 tokens" in err


def test_sim_calibrate_reports_its_progress_on_stderr(capsys, monkeypatch):
    import types

    import k3serve.sim.calibrate as calibrate

    def fake_row(row, routing="flat", device="as-recorded"):  # the real rows take 13 s: the wiring is tested
        return calibrate.CalibrationRow(row[0], 1.0, 1.0, 1.0, 1.0, routing)

    fake_run = types.SimpleNamespace(s_per_token=1.0, expert_bytes_per_token=1e9, expert_requests_per_token=1.0)
    monkeypatch.setattr(calibrate, "calibrate_row", fake_row)
    monkeypatch.setattr(calibrate, "c_engine_run", lambda *args, **kwargs: fake_run)
    assert main(["sim", "calibrate"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "published runs" in line]
    total = len(calibrate.LADDER + calibrate.SPLIT) + 1
    assert len(lines) == total and lines[-1].startswith(f"[100.0%] simulated {total} of {total} published runs")


def test_lab_list_prints_whole_numbers_and_the_models_own_ranges(capsys):
    from k3serve.cli.lab import _range
    from k3serve.lab.registry import Param

    assert main(["lab", "list"]) == 0
    out = capsys.readouterr().out
    assert "e+" not in out and "seed=0  (0..2147483647)" in out
    assert "layer=1  (1..7)" in out  # coactivation: the embedded model's MoE layers (limits), not the declared 0..200
    assert _range(Param("n", "int", 1, "", min=1)) == ">= 1" and _range(Param("x", "float", 0.5, "", max=0.5)) \
        == "<= 0.5"


def test_the_size_flags_say_which_units_are_binary_and_which_decimal():
    from k3serve.cli.main import build_parser
    from k3serve.units import format_size, parse_size

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    assert "8G = 8 GiB" in help_text and f"8GB = 8e9 bytes = {format_size(parse_size('8GB'))}" in help_text
    assert parse_size("8G") == 8 << 30 and parse_size("8GB") == 8 * 10**9


def _serve_app(monkeypatch, capsys, *flags: str):
    """Run `serve` up to the point where it would listen: the app it built and what it said on stderr. The
    listener is a stand-in, so no socket is bound beyond loopback."""
    import k3serve.cli.main as cli_main
    from k3serve.lab.fixtures import LabFixtures

    built: dict = {}
    monkeypatch.setattr(cli_main.cli_args, "bind_listener", lambda host, port: object())
    monkeypatch.setattr(cli_main, "_serve_until_sigterm", lambda server, listener: built.setdefault("app",
                        server.config.app))
    loads: list = []
    real_loaded = LabFixtures.loaded
    monkeypatch.setattr(LabFixtures, "loaded", lambda self: loads.append(self) or real_loaded(self))
    assert main(["serve", "--port", "8000", *flags]) == 0
    from fastapi.testclient import TestClient

    mounted = TestClient(built["app"]).get("/lab/api/modules").status_code == 200  # no lifespan: no engine thread
    return mounted, capsys.readouterr().err, loads


def test_serve_mounts_the_lab_on_loopback_only_unless_asked(monkeypatch, capsys):
    mounted, err, loads = _serve_app(monkeypatch, capsys, "--host", "127.0.0.1")
    assert mounted and "the lab is on http://127.0.0.1:8000/lab/" in err
    assert "warning" not in err
    assert loads == []  # the server process never loads the lab's model: the lab's worker process does

    mounted, err, _ = _serve_app(monkeypatch, capsys, "--host", "0.0.0.0")
    assert not mounted and "the lab is on" not in err
    assert "the lab is not mounted on 0.0.0.0" in err and "--lab" in err
    assert "without --tenants" in err and "/lab" not in err.split("warning:")[1].splitlines()[0]

    mounted, err, _ = _serve_app(monkeypatch, capsys, "--host", "0.0.0.0", "--lab")
    assert mounted and "the lab is on http://0.0.0.0:8000/lab/" in err
    warning = err.split("warning:")[1].splitlines()[0]
    assert "without --tenants" in warning and "the lab at /lab" in warning and "no authentication" in warning

    mounted, err, _ = _serve_app(monkeypatch, capsys, "--host", "127.0.0.1", "--no-lab")
    assert not mounted and "lab" not in err


def _memfd_inodes(pid: int) -> set[int]:
    from pathlib import Path

    return {int(line.split()[4]) for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if "/memfd:k3serve-weights" in line}


def test_serve_lends_its_model_to_the_lab_worker_read_only(monkeypatch, capsys):
    """Beside the lab, `serve` holds the model's weights in sealed shared pages (read-only views) and the lab's
    worker maps those same pages (the same memory file) instead of loading its own copy."""
    import os

    import k3serve.lab.api as lab_api
    from fastapi.testclient import TestClient

    from k3serve.weights.shared_pages import supported

    if not supported():
        pytest.skip("shared pages need Linux's memfd_create")
    queues: list = []
    real_mount = lab_api.mount_lab
    monkeypatch.setattr(lab_api, "mount_lab", lambda app, fixtures, **kw: queues.append(real_mount(app, fixtures,
                                                                                                  **kw)) or queues[-1])
    import k3serve.cli.main as cli_main

    built: dict = {}
    monkeypatch.setattr(cli_main.cli_args, "bind_listener", lambda host, port: object())
    monkeypatch.setattr(cli_main, "_serve_until_sigterm", lambda server, listener: built.setdefault("app",
                        server.config.app))
    assert main(["serve", "--port", "8000", "--host", "127.0.0.1"]) == 0
    queue = queues[0]
    try:
        shared = queue.fixtures.shared_weights
        assert shared is not None
        served = built["app"].state.k3.backend.engine.model.source
        embed = served.global_weights().embed
        assert not embed.flags.writeable and not served.stacked_experts(1)[0].flags.writeable
        assert shared.arrays.pages.inode in _memfd_inodes(os.getpid())
        run = TestClient(built["app"]).post("/lab/api/modules/prefix_cache/run?wait=true",
                                            json={"system_tokens": 64, "requests": 3})
        assert run.json()["status"] == "done", run.json()
        assert _memfd_inodes(queue.worker.pid) == {shared.arrays.pages.inode}
    finally:
        queue.close()
        built["app"].state.k3.backend.shutdown()


def test_the_lab_beside_serve_runs_on_the_served_model_only_when_it_is_a_k3_folder(tiny_dir, tiny_store, tmp_path):
    """A K3 GGUF file used to reach LabFixtures, which needs a folder, and stopped `serve` at start."""
    from types import SimpleNamespace

    from k3serve.cli.main import _lab_model
    from k3serve.loading.registry import ARCHITECTURES, K3

    k3, family = SimpleNamespace(architecture=K3), SimpleNamespace(architecture=ARCHITECTURES[1])
    gguf = tmp_path / "k3.gguf"
    gguf.write_bytes(b"GGUF")
    assert _lab_model(str(tiny_dir), k3) == str(tiny_dir)
    assert _lab_model(None, k3) is None  # the embedded default
    assert _lab_model(str(tiny_store.path), k3) is None and _lab_model(str(gguf), k3) is None
    assert _lab_model(str(tiny_dir), family) is None


def test_serve_refuses_lab_and_no_lab_together(capsys):
    assert "not allowed with argument" in _parse_error(["serve", "--lab", "--no-lab"], capsys)


def test_the_lab_beside_serve_answers_without_loading_a_model_in_the_server(monkeypatch):
    """Listing modules (their model-dependent ranges) reads the config only; runs go to the worker process."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from k3serve.lab.api import mount_lab
    from k3serve.lab.fixtures import LabFixtures

    def refuse(self):
        raise AssertionError("the server process loaded the lab's model")

    monkeypatch.setattr(LabFixtures, "loaded", refuse)
    app = FastAPI()
    queue = mount_lab(app, LabFixtures())
    try:
        modules = TestClient(app).get("/lab/api/modules").json()
        assert any(p["name"] == "layer" and p["max"] is not None for m in modules for p in m["params"])
        assert queue.worker.pid is None  # no worker process (the lab's copy of the model) before a run
    finally:
        queue.close()


def test_generate_expert_top_p_reports_the_kept_experts_and_a_lone_min_is_refused(tiny_dir, capsys):
    args = ["generate", "--model", str(tiny_dir), "--prompt-ids", "1,5,9,200", "--max-tokens", "4", "--ignore-eos"]
    assert main(args + ["--expert-top-p", "0.6", "--expert-top-p-min", "1"]) == 0
    err = capsys.readouterr().err
    assert "experts kept" in err and "of 2 per token and layer" in err and "--expert-top-p 0.6, min 1" in err
    assert main(args) == 0
    assert "experts kept" not in capsys.readouterr().err  # off by default: no line
    assert main(args + ["--expert-top-p-min", "1"]) == 2
    assert "--expert-top-p-min goes with --expert-top-p" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(args + ["--expert-top-p", "0"])


@pytest.mark.parametrize("command", ["serve", "cluster"])
def test_serve_and_cluster_pass_batch_by_experts_to_the_engine(command, capsys):
    from k3serve.cli.main import _engine_config, build_parser

    parser = build_parser()
    default = _engine_config(parser.parse_args([command]))
    assert (default.max_decode_seqs, default.batch_by_experts, default.batch_by_experts_max_wait) == (None, False, 4)
    config = _engine_config(parser.parse_args([command, "--max-decode-seqs", "8", "--batch-by-experts",
                                               "--batch-by-experts-max-wait", "2"]))
    assert (config.max_decode_seqs, config.batch_by_experts, config.batch_by_experts_max_wait) == (8, True, 2)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([command, "--max-decode-seqs", "0"])
    assert exit_info.value.code == 2 and "--max-decode-seqs" in capsys.readouterr().err


def test_wait_policy_and_activation_flags_reach_the_kernels_and_the_default_starts_core_keepers():
    """--wait-policy passive: no core keepers (said with -v); the default (adaptive) starts them on a machine with
    two or more cores, or says why not; the tokens are the same either way."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "K3SERVE_WAIT_POLICY")}
    runs = {}
    for policy in ("passive", None, "q8"):
        extra = (["--mxfp4-activations", "q8"] if policy == "q8" else ["--wait-policy", policy] if policy else [])
        result = subprocess.run([sys.executable, "-m", "k3serve.cli", "generate", "-v", "--prompt-ids", "5,6,7",
                                 "--max-tokens", "6", "--ignore-eos", *extra], capture_output=True, text=True,
                                timeout=300, env=env)
        assert result.returncode == 0, result.stderr
        runs[policy] = result
    assert "no core keepers: policy passive" in runs["passive"].stderr
    default = runs[None].stderr
    assert "core keepers: " in default and "policy passive" not in default
    assert runs["passive"].stdout == runs[None].stdout and runs[None].stdout.strip()
    # --mxfp4-activations q8 reaches the kernels: said at -v (or, on a CPU without the int8 instructions, refused)
    q8 = runs["q8"].stderr
    assert "routed MXFP4 experts on Q8_0 activations" in q8 or "lacks" in q8
    assert len(runs["q8"].stdout.strip().split(",")) == 6


def test_int8_activations_flag_reaches_the_kernels():
    """generate --int8-activations q8 sets the families' int8 experts on Q8_0 activations (read by the kernels at
    import); the MXFP4 switch stays at its default; an unknown value is refused by the parser."""
    import os

    from k3serve.cli.main import build_parser

    code = ("from k3serve.cli.main import build_parser, apply_wait_policy\n"
            "args = build_parser().parse_args(['generate', '--int8-activations', 'q8', '--prompt-ids', '1'])\n"
            "apply_wait_policy(args)\n"
            "from k3serve.model import kernels\n"
            "print(kernels.INT8_ACTIVATIONS if kernels.Q8_ISAS else 'q8', kernels.MXFP4_ACTIVATIONS)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("K3SERVE_INT8_ACTIVATIONS", "K3SERVE_MXFP4_ACTIVATIONS")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["q8", "f32"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--int8-activations", "int4"])


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bf16_activations_flag_sets_the_kernels_environment_before_their_import(command, monkeypatch, capsys):
    """--bf16-activations reaches K3SERVE_BF16_ACTIVATIONS (read once when the kernels are imported); with the
    kernels already imported it says so instead."""
    import os

    from k3serve.cli.main import apply_wait_policy, build_parser

    parser = build_parser()
    required = ["--prompt", "hi"] if command == "generate" else []
    args = parser.parse_args([command, *required, "--bf16-activations", "bf16"])
    # setenv first: delenv of an unset variable records nothing, and the flag's "bf16" outlived the test, reaching
    # every process later tests spawned (the lab's worker, the cluster's replicas) and changing their bits
    monkeypatch.setenv("K3SERVE_BF16_ACTIVATIONS", "f32")
    monkeypatch.delenv("K3SERVE_BF16_ACTIVATIONS")
    monkeypatch.delitem(sys.modules, "k3serve.model.kernels", raising=False)
    apply_wait_policy(args)
    assert os.environ["K3SERVE_BF16_ACTIVATIONS"] == "bf16"
    assert parser.parse_args([command, *required]).bf16_activations is None
    with pytest.raises(SystemExit):
        parser.parse_args([command, *required, "--bf16-activations", "fp8"])
    assert "--bf16-activations" in capsys.readouterr().err
