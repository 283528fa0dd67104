"""The command line: bad input gets one clear line and exit status 2, never a traceback."""
import subprocess
import sys

import pytest

from minillm.cli import main


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--model", "nosuch", "hi"], "neither a preset"),
    (["generate", "--dtype", "int8", "hi"], "unknown dtype"),
    (["generate", "--temperature", "-1", "hi"], "temperature"),
    (["roofline", "--batches", "0,2"], "batch sizes"),
    (["serve", "--port", "99999"], "port"),
    (["serve", "--scheduling-policy", "fifo"], "scheduling_policy must be one of chunked, prefill-first"),
    (["serve", "--max-num-batched-tokens", "0"], "max_num_batched_tokens"),
    (["serve", "--max-num-batched-tokens", "many"], "--max-num-batched-tokens: invalid int value"),
    (["serve", "--max-batch-size", "0"], "max_batch_size"),
    (["serve", "--kv-memory-fraction", "1.5"], "kv_memory_fraction"),
    (["serve", "--enforce-eager=yes"], "--enforce-eager"),
    (["generate", "--scheduling-policy", "fifo", "hi"], "scheduling_policy"),
    (["generate", "--max-model-len", "-3", "hi"], "max_model_len"),
    (["serve", "--no-such-flag"], "unrecognized arguments"),
])
def test_bad_input_is_one_clear_error(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err          # one line, not a screen of usage


def test_engine_flags_parse_into_engine_config():
    from minillm.cli import build_parser
    from minillm.engine.config import EngineConfig
    from minillm.serving.server import config_from_args
    a = build_parser().parse_args([
        "serve", "--model", "tiny", "--device", "cpu", "--scheduling-policy", "prefill-first",
        "--max-num-batched-tokens", "512", "--no-enable-prefix-caching", "--enforce-eager",
        "--max-batch-size", "8", "--max-model-len", "128", "--kv-memory-fraction", "0.25", "--port", "0"])
    want = EngineConfig(model="tiny", device="cpu", scheduling_policy="prefill-first",
                        max_num_batched_tokens=512,
                        enable_prefix_caching=False, enforce_eager=True, max_batch_size=8, max_model_len=128,
                        kv_memory_fraction=0.25)
    assert EngineConfig.from_args(a) == want
    cfg = config_from_args(a, EngineConfig.from_args(a))
    assert cfg.engine == want and cfg.port == 0
    # flags not given: EngineConfig's defaults, not the parser's
    d = build_parser().parse_args(["serve"])
    assert config_from_args(d).engine == EngineConfig()
    # generate: one KV slot unless told otherwise; its --seed seeds the sampling, not the weights
    g = build_parser().parse_args(["generate", "hi", "--seed", "5", "--enable-prefix-caching"])
    assert EngineConfig.from_args(g, exclude=("seed",), max_batch_size=1) == EngineConfig(max_batch_size=1)
    g = build_parser().parse_args(["generate", "hi", "--max-batch-size", "4", "--scheduling-policy",
                                   "chunked"])
    assert EngineConfig.from_args(g, exclude=("seed",), max_batch_size=1).max_batch_size == 4


def test_every_engine_option_has_a_flag():
    from minillm.cli import build_parser
    from minillm.engine.config import EngineConfig
    for command in ("serve", "generate"):
        sub = build_parser()._subparsers._group_actions[0].choices[command]
        flags = {s for action in sub._actions for s in action.option_strings}
        for name in EngineConfig.names():
            if name != "seed":                # a shape twin's weights (generate's --seed: the sampling's)
                assert "--" + name.replace("_", "-") in flags, (command, name)
    assert "--no-enable-prefix-caching" in flags and "--enforce-eager" in flags


def test_generate_streams_and_reports_metrics():
    r = subprocess.run([sys.executable, "-m", "minillm", "generate", "--model", "tiny", "--max-tokens", "8",
                        "--device", "cpu", "hello"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for word in ("TTFT", "TPOT", "tok/s", "bandwidth"):
        assert word in r.stderr


def test_serve_flags_reach_the_server_config(monkeypatch):
    from minillm.cli import build_parser
    from minillm.serving.config import config_from_args
    monkeypatch.setenv("MINILLM_ADMIN_KEY", "sk-admin-from-env")
    a = build_parser().parse_args(["serve", "--model", "tiny", "--device", "cpu", "--api-key", "sk-a",
                                   "--trace-store-bytes", "1048576", "--trace-history", "50",
                                   "--header-timeout-s", "2.5", "--max-connections", "0"])
    cfg = config_from_args(a)
    assert (cfg.admin_key, cfg.trace_store_bytes, cfg.trace_history) == ("sk-admin-from-env", 1 << 20, 50)
    assert cfg.header_timeout_s == 2.5 and cfg.max_connections is None and cfg.api_keys == ["sk-a"]
